"""Where a conversion's arithmetic runs: on the CPU, or on a CUDA GPU with the copies overlapped.

On a GPU the pipeline's reader thread uploads each shard on a stream of its own (the upload is
what reads the mapped file, so the next shard is read while the current one is quantized) and
records an event; each converter thread works on its own stream, waits for that event, runs the
transform (skyq.quant dispatches CUDA tensors to its Triton kernels, bit-identical to the
references) and copies the results back to host memory for the writer thread. The output bytes
do not depend on the device. On the CPU every step here is the identity.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


def resolve_device(name: str | None) -> torch.device:
    """`name` as a torch device; None means `cuda` when a GPU is visible, else `cpu`."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: not a device ({e}); use cpu or cuda[:N]") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: converters run on cpu or cuda[:N]")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(
                f"--device {name}: this machine has {count} visible CUDA GPU(s); use --device cpu"
            )
    return device


class DeviceStage:
    """Moves shards to the conversion device and results back; the identity on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._upload_stream = torch.cuda.Stream(device) if self.cuda else None
        self._local = threading.local()  # each converter thread's own stream

    def upload(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], object | None]:
        """(tensors on the device, an event the converters wait for); reader thread."""
        if not self.cuda:
            return tensors, None
        with torch.cuda.stream(self._upload_stream):
            staged = {name: t.to(self.device, non_blocking=True) for name, t in tensors.items()}
            ready = torch.cuda.Event()
            ready.record(self._upload_stream)
        return staged, ready

    @contextlib.contextmanager
    def converting(self, ready: object | None) -> Iterator[None]:
        """Run the body on this thread's stream once the shard's upload (`ready`) is done."""
        if not self.cuda:
            yield
            return
        if not hasattr(self._local, "stream"):
            self._local.stream = torch.cuda.Stream(self.device)
        stream = self._local.stream
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            yield

    def download(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors in host memory. A device-to-pageable copy returns once it is complete, so the
        stream has finished with the shard's inputs when the last of its tensors comes back; the
        inputs (allocated on the upload stream) are dropped only then, so no `record_stream`."""
        if not self.cuda:
            return tensors
        return {name: t.to("cpu") for name, t in tensors.items()}
