"""Where the arithmetic runs never changes a converter's output: `--device cuda` writes the bytes
`--device cpu` writes, and the compiled CPU FP8 kernel writes the bytes of the torch reference.

The GPU test needs only torch, safetensors and numpy (the checkpoint is built from skyq's layout,
not by transformers), so it runs on a GPU box without the training stack:
    pytest -q -m gpu tests/tools/test_device.py
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch
from checkpoint.tiny_checkpoints import dir_bytes, load_all, make_synthetic_qwen3_moe, reshard, scales_apart

from skyq.checkpoint import device, fp8_convert, fp8_cpu_kernel, pipeline
from skyq.tools import (
    convert_fp8_to_bf16,
    convert_hf_to_fp8,
    convert_hf_to_int4,
    convert_hf_to_mxfp8,
    convert_moe_int4_to_bf16,
)
from skyq.tools.cli import run_tool

QUANTIZE = {
    "fp8_block": (convert_hf_to_fp8, []),
    "fp8_pow2_96x64": (convert_hf_to_fp8, ["--block-size", "96", "64", "--scale-fmt", "ue8m0"]),
    "fp8_channel": (convert_hf_to_fp8, ["--strategy", "channel"]),
    "fp8_tensor": (convert_hf_to_fp8, ["--strategy", "tensor"]),
    "int4_g32": (convert_hf_to_int4, ["--group-size", "32"]),
    "int4_asymmetric": (convert_hf_to_int4, ["--group-size", "128", "--asymmetric"]),
    "mxfp8_all_linear": (convert_hf_to_mxfp8, ["--targets", "all_linear"]),
}
DEQUANTIZE = {  # input conversion -> tool that reads it back to BF16
    "fp8_block": convert_fp8_to_bf16,
    "fp8_channel": convert_fp8_to_bf16,
    "mxfp8_all_linear": convert_fp8_to_bf16,
    "int4_g32": convert_moe_int4_to_bf16,
    "int4_asymmetric": convert_moe_int4_to_bf16,
}


def _run(tool, model_dir: Path, out: Path, args: list[str]) -> Path:
    flag = "--output-dir" if tool is convert_moe_int4_to_bf16 else "--save-dir"
    assert tool.main(["--model-dir", str(model_dir), flag, str(out), "--max-workers", "2", *args]) == 0
    return out


def _assert_same_bytes(a: Path, b: Path, what: str) -> None:
    """Byte identity of two outputs; on failure, names the first differing file and tensor."""
    files_a, files_b = dir_bytes(a), dir_bytes(b)
    if files_a == files_b:
        return
    differ = sorted(n for n in files_a.keys() | files_b.keys() if files_a.get(n) != files_b.get(n))
    tensors_a, tensors_b = load_all(a), load_all(b)
    bad = [n for n in sorted(tensors_a) if n not in tensors_b or not torch.equal(
        tensors_a[n].view(torch.uint8), tensors_b[n].view(torch.uint8))]  # fmt: skip
    raise AssertionError(f"{what}: {a.name} and {b.name} differ in files {differ[:3]}, tensors {bad[:3]}")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("synthetic") / "bf16"
    make_synthetic_qwen3_moe(d)
    return d


def test_compiled_fp8_kernel_writes_the_reference_bytes(synthetic, tmp_path, monkeypatch):
    if not fp8_cpu_kernel.available():
        pytest.skip("no C compiler: the converter uses the reference only")
    args = ["--device", "cpu"]
    kernel = [_run(convert_hf_to_fp8, synthetic, tmp_path / f"k{i}", args + extra) for i, extra in
              enumerate([[], ["--scale-fmt", "ue8m0"], ["--block-size", "96", "64"]])]  # fmt: skip
    monkeypatch.setattr(fp8_cpu_kernel, "_library", lambda: None)
    for i, extra in enumerate([[], ["--scale-fmt", "ue8m0"], ["--block-size", "96", "64"]]):
        reference = _run(convert_hf_to_fp8, synthetic, tmp_path / f"r{i}", args + extra)
        assert dir_bytes(kernel[i]) == dir_bytes(reference)


def test_unusable_device_is_refused_before_writing(synthetic, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--model-dir", str(synthetic), "--save-dir", str(out)]
    assert run_tool(convert_hf_to_fp8.main, [*argv, "--device", "tpu"]) == 2
    assert "cpu or cuda" in capsys.readouterr().err
    many = torch.cuda.device_count() + 1 if torch.cuda.is_available() else 0
    assert run_tool(convert_hf_to_fp8.main, [*argv, "--device", f"cuda:{many}"]) == 2
    assert "--device cpu" in capsys.readouterr().err
    assert not out.exists() or not any(out.glob("*.safetensors"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(QUANTIZE))
def test_cuda_conversion_is_byte_identical_to_cpu(synthetic, tmp_path, name):
    tool, args = QUANTIZE[name]
    cpu = _run(tool, synthetic, tmp_path / "cpu", [*args, "--device", "cpu"])
    cuda = _run(tool, synthetic, tmp_path / "cuda", [*args, "--device", "cuda"])
    _assert_same_bytes(cpu, cuda, name)
    if name in DEQUANTIZE:  # scales in other shards than their weights: read through the index
        reshard(cpu, tmp_path / "split", max_shard_bytes=64 * 1024, place=scales_apart)
        back = {d: _run(DEQUANTIZE[name], tmp_path / "split", tmp_path / f"bf16_{d}", ["--device", d])
                for d in ("cpu", "cuda")}  # fmt: skip
        _assert_same_bytes(back["cpu"], back["cuda"], f"{name} -> bf16")


class _FakeCuda:
    """Stand-ins for torch.cuda's Stream / Event / stream(): they record the order of operations."""

    def __init__(self) -> None:
        self.current = threading.local()
        self.log: list[tuple[str, object, object]] = []  # (what, stream, event)

    def Stream(self, device=None):  # noqa: N802 - mirrors torch.cuda.Stream
        fake = self

        class Stream:
            def wait_event(self, event):
                assert event.recorded, "waited on an upload event that was never recorded"
                fake.log.append(("wait", self, event))

        return Stream()

    def Event(self):  # noqa: N802 - mirrors torch.cuda.Event
        class Event:
            recorded = False

            def record(self, stream):
                self.recorded = True

        return Event()

    @contextlib.contextmanager
    def stream(self, s):
        previous = getattr(self.current, "stream", None)
        self.current.stream = s
        try:
            yield
        finally:
            self.current.stream = previous


def test_cuda_staging_waits_for_each_upload_on_the_thread_stream(synthetic, tmp_path, monkeypatch):
    """The CUDA path's plumbing, run on the CPU with recording stand-ins for streams and events:
    every transform runs on its converter thread's own stream, after that stream waited for the
    upload event of the tensor's shard; the bytes equal a plain CPU run."""
    fake = _FakeCuda()
    for attr in ("Stream", "Event", "stream"):
        monkeypatch.setattr(torch.cuda, attr, getattr(fake, attr))

    class FakeCudaStage(device.DeviceStage):
        def __init__(self, _device):
            super().__init__(torch.device("cpu"))
            self.cuda, self._upload_stream = True, torch.cuda.Stream()

    monkeypatch.setattr(pipeline, "DeviceStage", FakeCudaStage)
    transform = fp8_convert.make_fp8_transform
    seen = []

    def checked_transform(*args, **kwargs):
        inner = transform(*args, **kwargs)

        def run(shard, tensors, names):
            stream = fake.current.stream
            assert stream is not None and ("wait", stream) in {(w, s) for w, s, _ in fake.log}
            seen.append((threading.get_ident(), id(stream)))
            return inner(shard, tensors, names)

        return run

    monkeypatch.setattr(convert_hf_to_fp8, "make_fp8_transform", checked_transform)
    staged = _run(convert_hf_to_fp8, synthetic, tmp_path / "staged", [])
    monkeypatch.undo()
    _assert_same_bytes(
        _run(convert_hf_to_fp8, synthetic, tmp_path / "plain", ["--device", "cpu"]), staged, "fp8"
    )
    shards = len(list(synthetic.glob("*.safetensors")))
    assert len({id(e) for _, _, e in fake.log}) == shards  # one upload event per shard, all waited on
    threads = {t for t, _ in set(seen)}
    assert len(set(seen)) == len(threads) == len({s for _, s in set(seen)})  # one stream per thread


@pytest.mark.parametrize("name", ["fp8_block", "int4_g32"])
def test_several_writer_threads_write_the_same_bytes(synthetic, tmp_path, monkeypatch, name):
    """On a GPU the converters write and hash shards on several threads; the output may not depend
    on it (checked here on the CPU by forcing three writers)."""
    from skyq.checkpoint import job

    tool, args = QUANTIZE[name]
    one = _run(tool, synthetic, tmp_path / "one", [*args, "--device", "cpu"])
    real = pipeline.run_conversion
    seen = []

    def three_writers(**kwargs):
        seen.append(kwargs.get("writers"))
        return real(**kwargs, writers=3)

    monkeypatch.setattr(job, "run_conversion", three_writers)
    three = _run(tool, synthetic, tmp_path / "three", [*args, "--device", "cpu"])
    assert seen == [None]
    _assert_same_bytes(one, three, f"{name} with 3 writer threads")
