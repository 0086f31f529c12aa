"""Per-worker resolution of fp8_recipe=auto, scale format and packing alignment."""

from __future__ import annotations

import pytest

from skyq.config.enums import Fp8Recipe, Precision, ScaleFormat
from skyq.config.resolve import ResolutionError, agree, packing_alignment, resolve_worker
from skyq.config.schema import PrecisionConfig

HOPPER, BLACKWELL = (9, 0), (10, 0)


def test_auto_resolves_from_the_workers_own_capability():
    p = PrecisionConfig(name=Precision.fp8_blockwise)
    assert resolve_worker(p, HOPPER).fp8_recipe is Fp8Recipe.blockwise
    assert resolve_worker(p, BLACKWELL).fp8_recipe is Fp8Recipe.mxfp8
    cpu = resolve_worker(p, None)
    assert cpu.fp8_recipe is Fp8Recipe.auto and cpu.emulated


def test_blackwell_blockwise_uses_pow2_scales():
    p = PrecisionConfig(name=Precision.fp8_blockwise, fp8_recipe=Fp8Recipe.blockwise)
    assert resolve_worker(p, BLACKWELL).scale_format is ScaleFormat.ue8m0
    assert resolve_worker(p, HOPPER).scale_format is ScaleFormat.fp32


def test_mxfp8_before_sm100_refused_unless_emulate():
    with pytest.raises(ResolutionError, match="precision.emulate=true"):
        resolve_worker(PrecisionConfig(name=Precision.mxfp8), HOPPER)
    r = resolve_worker(PrecisionConfig(name=Precision.mxfp8, emulate=True), HOPPER)
    assert r.fp8_recipe is Fp8Recipe.mxfp8 and r.emulated
    assert not resolve_worker(PrecisionConfig(name=Precision.mxfp8), BLACKWELL).emulated


def test_alignment_only_from_a_resolved_recipe():
    p = PrecisionConfig(name=Precision.fp8_blockwise)
    with pytest.raises(ResolutionError, match="resolved"):
        packing_alignment(p, resolve_worker(p, None), tp=2, cp=1)
    assert packing_alignment(p, resolve_worker(p, HOPPER), tp=2, cp=2) == 128 * 2 * 2
    assert packing_alignment(p, resolve_worker(p, HOPPER), tp=1, cp=2) == 16 * 2
    assert packing_alignment(p, resolve_worker(p, BLACKWELL), tp=2, cp=1) == 32 * 2
    b = PrecisionConfig(name=Precision.bf16)
    assert packing_alignment(b, resolve_worker(b, None), tp=4, cp=2) == 8


def test_driver_refuses_workers_that_disagree():
    p = PrecisionConfig(name=Precision.fp8_blockwise)
    same = [resolve_worker(p, HOPPER), resolve_worker(p, (9, 0))]
    assert agree(same).fp8_recipe is Fp8Recipe.blockwise
    with pytest.raises(ResolutionError, match="worker 1"):
        agree([resolve_worker(p, HOPPER), resolve_worker(p, BLACKWELL)])
