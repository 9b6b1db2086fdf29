"""Reading a drawn matplotlib figure back: every piece of text inside the canvas and clear of every
other (labels, tick labels, titles, colour-bar labels, legends as one box each). Used by the tests of
each figure npformer writes (the studies, npformer plot, the benchmark report)."""
from __future__ import annotations

import itertools


GAP_PX = 3          # the least space between two texts that reads as two


def text_boxes(fig) -> list[tuple[str, object]]:
    """(what, display box) of every visible, non-empty text of ``fig`` as drawn; a legend is one box."""
    renderer = fig.canvas.get_renderer()
    out = []
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    in_legend = {id(t) for leg in legends for t in leg.get_texts()} | {id(leg.get_title()) for leg in legends}
    for leg in legends:
        if leg.get_visible():
            out.append((f"legend {[t.get_text() for t in leg.get_texts()]}", leg.get_window_extent(renderer)))
    texts = list(fig.texts)
    if getattr(fig, "_suptitle", None) is not None:
        texts.append(fig._suptitle)
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts,
                  ax.xaxis.get_offset_text(), ax.yaxis.get_offset_text()]
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if low - 1e-9 * abs(high - low) <= tick.get_loc() <= high + 1e-9 * abs(high - low):
                    texts += [tick.label1, tick.label2]
    seen = set(in_legend)
    for t in texts:
        if t is None or id(t) in seen or not t.get_visible() or not t.get_text().strip():
            continue
        seen.add(id(t))
        out.append((f"text {t.get_text()!r}", t.get_window_extent(renderer)))
    return out


def assert_texts_inside_and_apart(fig, name: str, canvas=None) -> None:
    """Every text box of ``fig`` inside ``canvas`` (default the figure's, as a plain savefig writes it;
    one pixel of tolerance) and no two closer than :data:`GAP_PX`."""
    if not hasattr(fig.canvas, "get_renderer"):          # a Figure made without pyplot
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    canvas = fig.bbox if canvas is None else canvas
    boxes = text_boxes(fig)
    for what, box in boxes:
        assert (box.x0 >= canvas.x0 - 1 and box.y0 >= canvas.y0 - 1 and box.x1 <= canvas.x1 + 1
                and box.y1 <= canvas.y1 + 1), f"{name}: the {what} is cut off by the canvas edge ({box} in {canvas})"
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.padded(GAP_PX / 2).overlaps(box_b.padded(GAP_PX / 2)), \
            f"{name}: the {a} and the {b} overlap or touch (less than {GAP_PX} px apart)"
