"""The point-to-point links of a pipeline stage: activations forward to the next stage, gradients back to the
previous one (picotron's ``pipeline_communicate``; Megatron-LM's ``p2p_communication.py``).

Sends are non-blocking (``isend``) and waited for at the end of the step, so no stage ever blocks on a send and the
order of the schedule alone decides who waits for whom; receives block (``irecv`` + ``wait``), timed as ``recv``
spans of the :class:`~torch_handle.parallel.pipeline.timeline.Timeline` and named in the heartbeat's phase
(``recv activation mb 3 from stage 0``), so a hang report says what each stage waits for.

Every tensor travels with a small header (its shape and dtype), so stages need no shape inference and a
micro-batch may differ in shape from the last (as a padded batch of another length would).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_handle.observe.heartbeat import beat
from torch_handle.parallel.pipeline.timeline import Timeline

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # dtype code, ndim, up to 6 sizes


class StageLink:
    """Sends and receives of stage ``stage`` (of ``n_stages``, one per rank of ``group``).

    Args:
        group: the pipeline process group; ``ranks[s]`` is the global rank that runs stage ``s``.
        ranks: global rank of every stage.
        stage: this rank's stage.
        device: where received tensors are allocated.
        timeline: records receive waits.
    """

    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int], stage: int, device: torch.device,
                 timeline: Timeline):
        self.group, self.ranks, self.stage, self.device, self.timeline = group, ranks, stage, device, timeline
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, t: torch.Tensor, to_stage: int) -> None:
        t = t.detach().contiguous()
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
        header[2:2 + t.dim()] = torch.tensor(t.shape)
        dst = self.ranks[to_stage]
        for x in (header.to(self.device), t):
            self._pending.append((dist.isend(x, dst=dst, group=self.group), x))

    def _recv(self, from_stage: int, what: str, microbatch: int) -> torch.Tensor:
        src = self.ranks[from_stage]
        beat(f"recv {what} mb {microbatch} from stage {from_stage}")
        with self.timeline.span("recv", microbatch, self.stage):
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.irecv(header, src=src, group=self.group).wait()
            header = header.tolist()
            t = torch.empty(header[2:2 + header[1]], dtype=_DTYPES[header[0]], device=self.device)
            dist.irecv(t, src=src, group=self.group).wait()
        return t

    def send_activation(self, t: torch.Tensor, microbatch: int) -> None:
        """Send this stage's output of ``microbatch`` to the next stage (non-blocking)."""
        beat(f"send activation mb {microbatch} to stage {self.stage + 1}")
        self._send(t, self.stage + 1)

    def recv_activation(self, microbatch: int) -> torch.Tensor:
        """The previous stage's output of ``microbatch`` (blocking); a leaf that requires grad."""
        return self._recv(self.stage - 1, "activation", microbatch).requires_grad_()

    def send_grad(self, t: torch.Tensor, microbatch: int) -> None:
        """Send the gradient of this stage's input of ``microbatch`` to the previous stage (non-blocking)."""
        beat(f"send gradient mb {microbatch} to stage {self.stage - 1}")
        self._send(t, self.stage - 1)

    def recv_grad(self, microbatch: int) -> torch.Tensor:
        """The next stage's gradient of this stage's output of ``microbatch`` (blocking)."""
        return self._recv(self.stage + 1, "gradient", microbatch)

    def flush(self) -> None:
        """Wait for every send of the step (their buffers are kept alive until then)."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []
