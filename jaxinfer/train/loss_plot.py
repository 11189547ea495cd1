"""The training curve of a draft head as an SVG file, written as plain text (no plotting
library): the loss per step (a line on the left axis) and the acceptance where it was measured
(on the right axis: held-out as dots, on the training answers as rings), from the records
`draft_head.fit` logs (the lines of history.jsonl)."""

from __future__ import annotations

from xml.sax.saxutils import escape

WIDTH, HEIGHT = 640, 360
LEFT, RIGHT, TOP, BOTTOM = 64, 64, 32, 48  # margins: the axes' labels sit in them


def _scale(lo: float, hi: float, out_lo: float, out_hi: float):
    span = hi - lo or 1.0
    return lambda v: out_lo + (v - lo) / span * (out_hi - out_lo)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def loss_svg(history: list[dict], title: str = "draft head training") -> str:
    """The SVG document of `history` (records with "step", "loss" and, on some, "acceptance"
    and "train_acceptance": mean tokens per verification). Raises ValueError on an empty
    history."""
    if not history:
        raise ValueError("no training records to plot (history is empty)")
    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    acc = [(r["step"], r["acceptance"]) for r in history if "acceptance" in r]
    seen = [(r["step"], r["train_acceptance"]) for r in history if "train_acceptance" in r]
    x = _scale(min(steps), max(steps), LEFT, WIDTH - RIGHT)
    y = _scale(min(losses), max(losses), HEIGHT - BOTTOM, TOP)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="13">'
           f'{escape(title)}</text>',
           f'<path d="M{LEFT},{TOP}V{HEIGHT - BOTTOM}H{WIDTH - RIGHT}" stroke="black" '
           'fill="none"/>']
    for v in _ticks(min(losses), max(losses)):
        out.append(f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for v in _ticks(min(steps), max(steps)):
        out.append(f'<text x="{x(v):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">'
                   f'{v:.0f}</text>')
    out.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 10}" text-anchor="middle">step</text>')
    out.append(f'<text x="14" y="{HEIGHT / 2}" text-anchor="middle" fill="#1f77b4" '
               f'transform="rotate(-90 14 {HEIGHT / 2})">loss</text>')
    points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, losses))
    out.append(f'<polyline class="loss" points="{points}" fill="none" stroke="#1f77b4" '
               'stroke-width="1.5"/>')
    if acc:
        values = [a for _, a in acc + seen]
        ya = _scale(min(values), max(values), HEIGHT - BOTTOM, TOP)
        out.append(f'<path d="M{WIDTH - RIGHT},{TOP}V{HEIGHT - BOTTOM}" stroke="black"/>')
        for v in _ticks(min(values), max(values)):
            out.append(f'<text x="{WIDTH - RIGHT + 6}" y="{ya(v) + 4:.1f}" fill="#d62728">'
                       f'{v:.3g}</text>')
        out.append(f'<text x="{WIDTH - 12}" y="{HEIGHT / 2}" text-anchor="middle" '
                   f'fill="#d62728" transform="rotate(90 {WIDTH - 12} {HEIGHT / 2})">'
                   'acceptance: held out (dots), trained on (rings)</text>')
        for s, v in acc:
            out.append(f'<circle class="acceptance" cx="{x(s):.1f}" cy="{ya(v):.1f}" r="3.5" '
                       'fill="#d62728"/>')
        for s, v in seen:
            out.append(f'<circle class="train-acceptance" cx="{x(s):.1f}" cy="{ya(v):.1f}" '
                       'r="3.5" fill="none" stroke="#d62728"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_loss_svg(history: list[dict], path: str, title: str = "draft head training") -> None:
    """Writes `loss_svg(history, title)` to `path`."""
    with open(path, "w") as f:
        f.write(loss_svg(history, title))
