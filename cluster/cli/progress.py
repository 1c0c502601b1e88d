"""The live progress display of a training run (rich), and its plain-log fallback."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}"
    return str(v)


class TrainProgress:
    """Step, version, reward per head, KL terms, λ_KL, videos/s, staleness and time left."""

    KEYS = ("loss", "clipfrac", "ratio_mean", "kl/d_anchor", "kl/d_step", "loss/align", "kl/lambda", "grad_norm")

    def __init__(self, total_steps: int, heads: list[str], console: Console | None = None,
                 start_step: int = 0):
        self.console = console or Console()
        self.heads = heads
        self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                            console=self.console)
        self.task = self.bar.add_task("train", total=total_steps, completed=start_step, rate="")
        self.last: dict[str, Any] = {}
        self.live = Live(self._render(), console=self.console, refresh_per_second=4,
                         transient=False, redirect_stdout=False)
        self.t0 = time.monotonic()

    def _render(self):
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column(overflow="fold")
        r = self.last
        if r:
            t.add_row("step", f"{r.get('step')}   version {r.get('version')}   "
                      f"staleness {_fmt(r.get('staleness_mean', 0.0))}   "
                      f"groups produced {r.get('groups_produced')} trained {r.get('groups_trained')}")
            heads = "  ".join(f"{h} {_fmt(r.get(f'reward/{h}', float('nan')))}" for h in self.heads)
            t.add_row("reward", f"{_fmt(r.get('reward_mean'))}   {heads}")
            kl = "  ".join(f"{k} {_fmt(r[k])}" for k in self.KEYS if k in r)
            t.add_row("learner", kl)
        return Group(self.bar, t)

    def __enter__(self) -> TrainProgress:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def update(self, record: dict[str, Any]) -> None:
        self.last = record
        vps = record.get("videos_per_s")
        self.bar.update(self.task, completed=record.get("step", 0),
                        rate=f"{vps:.2f} videos/s" if vps else "")
        self.live.update(self._render())

    def note(self, text: str) -> None:
        self.console.log(text)
