"""`vgrpo sde-report`: per-step noise std of every SDE scheme, and the equalizer weights.

The three regimes follow the SAGE-GRPO paper's appendix A.2:
  a  both use FlowGRPO's σ handling: σ_k = 1 is replaced by σ_1 (sage's first interval collapses)
  b  both clamp 1-σ ≥ c (FlowGRPO's first step explodes; sage stays near 1)
  c  each its default: FlowGRPO's σ_1 trick, sage's clamp
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.config import ConfigError

REGIMES = {
    "a": "both with FlowGRPO's σ schedule (σ=1 → σ_1)",
    "b": "both clamped at 1-σ ≥ c",
    "c": "each its default",
}


def register(sub) -> None:
    p = sub.add_parser(
        "sde-report", help="print the per-step std of every SDE scheme and the equalizer weights",
        description="Print, per step, the transition std of every SDE scheme under the three "
        "regimes of the SAGE-GRPO paper's appendix A.2, and the gradient-norm-equalizer "
        "weights; write a PNG plot of std per step.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="number of sampling steps T")
    p.add_argument("--shift", type=float, default=1.0, help="time shift s of the schedule")
    p.add_argument("--eta", type=float, default=None,
                   help="noise level η for every scheme (default: each scheme's own default)")
    p.add_argument("--clamp", type=float, default=3e-3, help="c in the clamp 1-σ ≥ c")
    p.add_argument("--out", default="sde_report.png", help="where to write the PNG plot")
    p.set_defaults(func=run)


def regime_stds(regime: str, steps: int, shift: float, eta: float | None, c: float) -> dict[str, list[float]]:
    """std per step for every scheme under one regime."""
    # lazy: torch (kept out of vgrpo --help)
    from common.sde import Flow, Sage, Schedule, make_scheme

    sched = Schedule.linear(steps, shift)
    sigma1 = sched.sigmas[1]
    out: dict[str, list[float]] = {}
    for name in ("ode", "dance", "cps"):
        sc = make_scheme(name, eta, sched)
        out[name] = [float(sc.std(*sched.pair(k))) for k in range(steps)]
    flow = make_scheme("flow", eta, sched, flow_first_step="clamp" if regime == "b" else "sigma1",
                       clamp_c=c)
    assert isinstance(flow, Flow)
    out["flow"] = [float(flow.std(*sched.pair(k))) for k in range(steps)]
    sage = make_scheme("sage", eta, sched, clamp_c=c)
    assert isinstance(sage, Sage)
    stds = []
    for k in range(steps):
        s, s_next = sched.pair(k)
        if regime == "a" and s >= 1.0:
            s = sigma1  # FlowGRPO's trick collapses the integration interval
        stds.append(float(sage.std(s, s_next)))
    out["sage"] = stds
    return out


def run(args) -> int:
    # lazy: rich (kept out of vgrpo --help)
    from rich.console import Console
    from rich.table import Table

    # lazy: torch (kept out of vgrpo --help)
    from common.sde import Schedule, equalizer_weights, make_scheme

    if args.steps < 1:
        raise ConfigError(f"--steps = {args.steps}: must be ≥ 1")
    if args.shift <= 0:
        raise ConfigError(f"--shift = {args.shift}: must be > 0")
    if args.eta is not None and args.eta < 0:
        raise ConfigError(f"--eta = {args.eta}: must be ≥ 0")
    console = Console()
    sched = Schedule.linear(args.steps, args.shift)
    data = {r: regime_stds(r, args.steps, args.shift, args.eta, args.clamp) for r in REGIMES}

    eta_txt = f"η={args.eta}" if args.eta is not None else "η=scheme defaults"
    table = Table(title=f"FlowGRPO vs precise (sage) std per step\nT={args.steps}, shift={args.shift}, {eta_txt}, c={args.clamp}")
    table.add_column("k", justify="right")
    table.add_column("σ_k", justify="right")
    for r in REGIMES:
        table.add_column(f"flow {r}", justify="right")
        table.add_column(f"sage {r}", justify="right")
    table.add_column("var ratio flow/sage c", justify="right")
    for k in range(args.steps):
        row = [str(k), f"{sched.sigmas[k]:.3f}"]
        for r in REGIMES:
            row += [f"{data[r]['flow'][k]:.3f}", f"{data[r]['sage'][k]:.3f}"]
        f, s = data["c"]["flow"][k], data["c"]["sage"][k]
        row.append(f"{(f / s) ** 2:.2f}" if s > 0 else "—")
        table.add_row(*row)
    console.print(table)
    for r, text in REGIMES.items():
        console.print(f"  regime {r}: {text}")

    names = ("dance", "flow", "cps", "sage")
    weights = {n: equalizer_weights(make_scheme(n, args.eta, sched, clamp_c=args.clamp), sched) for n in names}
    wt = Table(title="other schemes' std, and equalizer weights w_k = median(N)/N_k (regime c)")
    wt.add_column("k", justify="right")
    wt.add_column("std dance", justify="right")
    wt.add_column("std cps", justify="right")
    for n in names:
        wt.add_column(f"w {n}", justify="right")
    for k in range(args.steps):
        wt.add_row(str(k), f"{data['c']['dance'][k]:.3f}", f"{data['c']['cps'][k]:.3f}",
                   *[f"{float(weights[n][k]):.3f}" for n in names])
    console.print(wt)

    out = write_plot(data, sched, Path(args.out), args)
    console.print(f"plot written to {out}")
    return 0


def write_plot(data, sched, out: Path, args) -> Path:
    import matplotlib  # lazy: matplotlib (kept out of vgrpo --help)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib (kept out of vgrpo --help)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    ks = list(range(sched.steps))
    for ax, (r, text) in zip(axes, REGIMES.items(), strict=True):
        for name in ("dance", "flow", "cps", "sage"):
            ax.plot(ks, data[r][name], marker="o", ms=3, label=name)
        ax.set_title(f"({r}) {text}", fontsize=10)
        ax.set_xlabel("step k")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("transition std")
    axes[0].legend()
    fig.suptitle(f"SDE std per step: T={args.steps}, shift={args.shift}, "
                 f"η={'defaults' if args.eta is None else args.eta}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
