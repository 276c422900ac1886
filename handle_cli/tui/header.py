"""The status header: the run's status, layout, progress and latest figures on two lines (three with a message),
leaving out the least important parts first on a narrow terminal."""

from __future__ import annotations

import textwrap

from rich.text import Text
from textual.widget import Widget

from handle_cli.tui.text_fit import Piece, fit
from torch_handle.common.text import clean, fmt_duration, fmt_float
from torch_handle.observe.data_mix import shares_text
from torch_handle.observe.fields import Status
from torch_handle.observe.state import RunState

STATUS_STYLES = {
    Status.RUNNING: "bold black on green",
    Status.FINISHED: "bold white on blue",
    Status.FAILED: "bold white on red",
    Status.STOPPED: "bold black on yellow",
    Status.RESTARTING: "bold black on magenta",
    Status.STARTING: "bold black on cyan",
    Status.LOST: "bold white on red",
    Status.HUNG: "bold white on red",
}
MESSAGE_STYLES = {Status.FAILED: "bold red", Status.LOST: "bold red", Status.HUNG: "bold red",
                  Status.STOPPED: "yellow", Status.RESTARTING: "magenta"}
HANG_LINES = 3
"""A watchdog's hang message (where each rank waits) may wrap over this many header lines; others take one."""


def _piece(*parts: str | tuple[str, str]) -> Text:
    return Text.assemble(*parts)


class StatusHeader(Widget):
    """Status badge, preset, layout (:class:`~torch_handle.common.run_layout.RunLayout`'s line: dp × tp × pp and
    the strategy; on a narrow screen the degrees alone), precision, world size, progress, ETA, elapsed; then the
    latest numbers; then the failure or stop message. Parts that do not fit the width are shortened or left out,
    least important first: 80 columns keep the layout's degrees, the world size, elapsed and the grad norm."""

    DEFAULT_CSS = """
    StatusHeader { height: auto; padding: 0 1; background: $panel; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.state: RunState | None = None
        self.paused = False
        self.bad_lines = 0

    def show(self, state: RunState, *, paused: bool, bad_lines: int) -> None:
        self.state, self.paused, self.bad_lines = state, paused, bad_lines
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:  # noqa: ANN001
        return len(self.lines(max(20, width)))

    def render(self) -> Text:
        return Text("\n", no_wrap=True, end="").join(self.lines(max(20, self.size.width)))

    @property
    def plain(self) -> str:
        return "\n".join(line.plain for line in self.lines(max(20, self.size.width)))

    def lines(self, width: int) -> list[Text]:
        state = self.state
        if state is None:
            return [Text("loading…")]
        status = state.status
        total = state.steps_total
        step = state.step
        p1: list[Piece] = [(0, Text(f" {status.upper()} ", STATUS_STYLES.get(status, "reverse")))]
        p1.append((1, _piece("  ", (state.preset, "bold"))))
        if state.finetune:  # QLoRA named as such: the method, its rank and the NF4 base
            p1.append((2, _piece("  ", (state.finetune, "magenta"))))
        layout = state.run_layout  # the line every view shows (dp × tp × pp, implementations, strategy)
        if layout.dp is not None:  # narrower: the degrees alone, then without spaces (80 columns keep them)
            degrees = layout.degrees_text()
            p1.append([(6, _piece("  ", (layout.label(), "cyan"))), (4, _piece("  ", (degrees, "cyan"))),
                       (1, _piece("  ", (degrees.replace(" ", ""), "cyan")))])
        else:
            p1.append((2, _piece("  ", (layout.strategy_text, "cyan"))))
        if state.precision:  # run.json's: the concrete one "auto" resolved to
            p1.append((7, _piece("  ", (state.precision, "cyan"))))  # the first to go on a narrow screen
        p1.append((1, _piece(f"  world {state.world_size if state.world_size is not None else '?'}")))
        p1.append((0, _piece("  step ", (f"{step}/{total if total else '?'}", "bold"))))
        if total:
            frac = min(1.0, max(0.0, step / total))
            filled = round(frac * 10)
            p1.append((6, _piece(" ", ("━" * filled, "green"), ("━" * (10 - filled), "grey37"))))
            p1.append((4, _piece(f" {frac * 100:.0f}%")))
        eta = state.eta_s()
        p1.append((2 if eta is not None else 5, _piece(f"  ETA {fmt_duration(eta)}")))
        p1.append((3, _piece(f"  elapsed {fmt_duration(state.elapsed_s())}")))
        if state.restarts:
            p1.append((1, _piece(("  restarts ", "magenta"), (str(state.restarts), "bold magenta"))))
        if self.paused:
            p1.append((0, _piece("  ", (" PAUSED ", "bold black on yellow"))))

        p2: list[Piece] = [(0, _piece("loss ", (fmt_float(state.last_loss), "bold")))]
        p2.append((1, _piece("  val ", (fmt_float(state.last_val_loss), "bold"))))
        tps = state.last(state.tokens_per_s)
        p2.append((2, _piece(f"  {tps:,.0f} tok/s" if tps is not None else "  - tok/s")))
        if state.trained_share is not None:  # SFT: the trained tokens among those computed (absent otherwise)
            trained = state.last(state.trained_tokens_per_s)
            rate = f" {trained:,.0f}/s" if trained is not None else ""
            p2.append([(5, _piece("  trained ", (f"{state.trained_share:.0%}", "bold"), rate)),
                       (1, _piece("  trained ", (f"{state.trained_share:.0%}", "bold")))])
        st = state.last(state.step_time_s)
        p2.append((5, _piece(f"  {st:.3f} s/step" if st is not None else "  - s/step")))  # the chart has it
        comm = state.last(state.comm_s)
        if comm is not None:  # only strategies that report it (scratch-ddp): the line is unchanged otherwise
            p2.append((4, _piece(f"  dp comm {comm * 1000:.0f} ms")))
        if state.mfu is not None:  # only runs whose events carry it: the line is unchanged otherwise
            p2.append((2, _piece("  mfu ", (f"{state.mfu:.1%}", "bold"))))
        lr = state.last(state.lr)
        p2.append((3, _piece(f"  lr {lr:.2e}" if lr is not None else "  lr -")))
        if state.grad_norm is not None:
            p2.append((4, _piece(f"  grad norm {state.grad_norm:.2f}")))
        if self.bad_lines:
            n = self.bad_lines
            p2.append((0, _piece("  ", (f"⚠ {n} bad line{'s' if n != 1 else ''}", "bold yellow"))))
        p2.append((6, _piece("  ", (clean(state.run_dir.name, 80), "dim"))))

        lines = [fit(p1, width), fit(p2, width)]
        if totals := state.source_totals:  # a data mixture: each source's share of the tokens so far
            lines.append(Text.assemble(("data ", "bold"), shares_text(totals, width - 5), no_wrap=True, end=""))
        message = state.message
        if message and status in MESSAGE_STYLES:
            text = ("error: " if status == Status.FAILED else "") + message
            if message.startswith("hang:"):
                for part in textwrap.wrap(text, width, max_lines=HANG_LINES, placeholder=" …"):
                    lines.append(Text(part, MESSAGE_STYLES[status], no_wrap=True, end=""))
                return lines
            line = Text(text, MESSAGE_STYLES[status], no_wrap=True, overflow="ellipsis", end="")
            line.truncate(width, overflow="ellipsis")
            lines.append(line)
        return lines
