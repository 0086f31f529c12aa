"""W4A16 (precision=int4_qat) in a real vLLM 0.26 engine on the GPU, fed through skyq's accounted sync.

vLLM 0.26's W4A16 MoE layers (compressed-tensors WNA16 through Marlin) hold activation-order tensors no
checkpoint without act order fills (`compat.checkpoint_copies` counts them as vLLM's reload does). An
engine booted with dummy W4A16 weights takes skyq's INT4 sync and then equals, bit for bit (greedy
tokens, log-probs, every parameter and buffer, the attention layers' KV-cache scales included: see
`dummy_loader`), an engine booted from skyq's INT4 converter output of the same weights; a different
version changes its outputs and syncing the first weights again (a reload into the Marlin-repacked
layers) restores them. Needs CUDA and vLLM 0.26 (the staged GPU environment); the
engines run one at a time in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        getattr(importlib.util.find_spec("vllm"), "origin", None) is None,
        reason="needs vLLM (0.26 on the GPU)",
    ),
]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))  # the sending side shared with tests/vllm

from skyq.config.enums import Precision, QuantScope  # noqa: E402
from skyq.config.schema import ModelConfig, PrecisionConfig, RolloutConfig  # noqa: E402
from skyq.quant.plan import build_plan  # noqa: E402
from skyq.quant.strategies import get_strategy  # noqa: E402
from skyq.sync.plan_wire import plan_serializer  # noqa: E402
from skyq.tools import convert_hf_to_int4  # noqa: E402
from skyq.trainer.native.model import write_hf_checkpoint  # noqa: E402

MODEL = ModelConfig(head_dim=64, hidden_size=256, moe_intermediate_size=256)
"""Marlin's MoE shapes: hidden a multiple of 128, expert width of 64 and of the group."""
PROMPTS = [[1, 5, 7, 2], [3, 3, 9, 11, 4, 2], [(7 * i + 3) % 30 + 1 for i in range(40)]]


def _engine(path: Path, precision_cfg: PrecisionConfig, *, dummy: bool):
    from skyq.rollout.vllm.engine import VllmEngine
    from skyq.rollout.vllm.engine_args import VllmOptions, engine_kwargs

    kwargs = engine_kwargs(
        model_path=str(path), model_cfg=MODEL, precision_cfg=precision_cfg,
        rollout_cfg=RolloutConfig(gpu_memory_fraction=0.05), seed=0,
        options=VllmOptions(max_model_len=256, max_num_seqs=8, kv_cache_bytes=64 << 20, dummy_weights=dummy,
                            device="cuda"),
    )  # fmt: skip
    return VllmEngine(llm_kwargs=kwargs, model_cfg=MODEL, precision_cfg=precision_cfg)


def _int4_checkpoint(
    tmp_path: Path, weights: dict[str, torch.Tensor], precision_cfg: PrecisionConfig
) -> Path:
    """`weights` as a W4A16 checkpoint: skyq's INT4 converter's output for the routed experts (its
    scope); for a wider QAT scope, which the converter does not quantize, the plan's wire tensors with
    the strategy's `quantization_config`."""
    if precision_cfg.qat_scope is QuantScope.routed_experts:
        argv = [
            "--model-dir",
            str(tmp_path / "new"),
            "--save-dir",
            str(tmp_path / "new_int4"),
            "--device",
            "cpu",
        ]
        assert convert_hf_to_int4.main(argv) == 0
        return tmp_path / "new_int4"
    plan = build_plan(MODEL, precision_cfg)
    serialize = plan_serializer(get_strategy(precision_cfg), plan)
    wire = {n: t for p in plan for n, t in serialize(p.name, weights[p.name]).items()}
    out = write_hf_checkpoint(tmp_path / "new_int4", wire, MODEL)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = get_strategy(precision_cfg).quantization_config(plan)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _greedy(engine) -> list[tuple[list[int], list[float]]]:
    samples = engine.generate(PROMPTS, n=1, max_new_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    return [(s.response_ids, s.logprobs) for s in samples]


@pytest.mark.parametrize("scope", [QuantScope.routed_experts, QuantScope.all_linear])
def test_int4_sync_matches_engine_booted_from_converted_checkpoint(tmp_path, scope):
    from vllm_sync import SyncTrainer, perturbed, random_weights

    from skyq.rollout.vllm.compat import check_version

    if check_version() != "0.26":
        pytest.skip("the W4A16 act-order accounting is checked on vLLM 0.26 (the GPU version)")
    precision_cfg = PrecisionConfig(name=Precision.int4_qat, qat_scope=scope)
    base = random_weights(MODEL, 0)
    new = perturbed(base, 1)
    write_hf_checkpoint(tmp_path / "base", base, MODEL)
    write_hf_checkpoint(tmp_path / "new", new, MODEL)
    reference = _engine(_int4_checkpoint(tmp_path, new, precision_cfg), precision_cfg, dummy=False)
    try:
        want, want_sums = _greedy(reference), reference.weight_checksums()
    finally:
        reference.shutdown()
    engine = _engine(tmp_path / "base", precision_cfg, dummy=True)
    try:
        trainer = SyncTrainer(engine, model_cfg=MODEL, precision_cfg=precision_cfg)
        assert trainer.sync(list(new.items()), 1)["version"] == 1
        assert _greedy(engine) == want
        assert engine.weight_checksums() == want_sums
        trainer.sync(list(perturbed(base, 2).items()), 2)
        assert _greedy(engine) != want
        trainer.sync(list(new.items()), 3)  # reloads into the Marlin-repacked layers
        assert _greedy(engine) == want
        assert engine.weight_checksums() == want_sums
    finally:
        engine.shutdown()
