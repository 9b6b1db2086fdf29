"""The study plots read well: each study is run tiny with its figure captured before it is closed,
and the matplotlib objects are inspected: readable legend names (no code names), every colour bar
labelled, no legend or text with a curve or bar running through it, recall accuracy in the
Transformer-XL study."""
import importlib

import numpy
import pytest

from npformer.cli import main
from npformer.study import EXPERIMENTS
from tests.figure_checks import assert_texts_inside_and_apart
from tests.helpers import NO_MATPLOTLIB

matplotlib = pytest.importorskip("matplotlib", reason=NO_MATPLOTLIB)
from matplotlib.transforms import Bbox  # noqa: E402  (after the skip without matplotlib)

TINY = {
    "norms": ["--steps", "3", "--batch-size", "4", "--d-model", "8", "--ff", "8", "--max-len", "6", "--n-valid", "8",
              "--eval-batch", "8", "--probes", "2", "--extra-pad", "4"],
    "xl-memory": ["--segment", "4", "--d-model", "16", "--heads", "2", "--ff", "16", "--batch-size", "4",
                  "--n-train", "40", "--n-valid", "4", "--steps", "4", "--eval-every", "2", "--eval-mem", "0,4,8"],
    "layers": ["--layers", "2", "--d-model", "8", "--heads", "2", "--ff", "8", "--block-size", "6", "--steps", "3",
               "--batch-size", "2", "--valid-batches", "1"],
    "gradient-flow": ["--seq-len", "6", "--steps", "2", "--batch-size", "2", "--eval-batch", "3"],
    "positional": ["--positions", "12", "--d-model", "6"],
    "albert": ["--shapes", "char"],
    "attention": ["--d-model", "8", "--heads", "2", "--layers", "1", "--ff", "8"],
}


def figures_of(name, tmp_path, monkeypatch, capsys, args=None) -> list:
    """The figures study ``name`` saves (with ``args``, default its tiny settings), drawn and still
    open, each with the canvas it is saved on (save_figure's tight box) as ``fig.saved_canvas``."""
    module = importlib.import_module(EXPERIMENTS[name].module)
    figures = []

    def capture(fig, path):
        fig.savefig(path, dpi=120, bbox_inches="tight")    # as save_figure: every artist in its place
        fig.saved_canvas = fig.get_tightbbox(fig.canvas.get_renderer()).transformed(fig.dpi_scale_trans)
        figures.append(fig)
        return path
    monkeypatch.setattr(module, "save_figure", capture)
    assert main(["study", name, *(TINY[name] if args is None else args), "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert figures, f"study {name} saved no figure"
    return figures


def legends(fig) -> list:
    return [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)


def legend_texts(fig) -> list[str]:
    return [t.get_text() for leg in legends(fig) for t in leg.get_texts()]


def _segments_through(box, line) -> bool:
    """Whether ``line``, drawn, passes through the display box ``box`` (points sampled along it)."""
    xy = line.get_transform().transform(numpy.asarray(line.get_xydata(), dtype=float))      # (N, 2) pixels
    xy = xy[numpy.isfinite(xy).all(axis=1)]
    if len(xy) == 0:
        return False
    t = numpy.linspace(0, 1, 25)[:, None, None]
    points = (xy[:-1] + t * (xy[1:] - xy[:-1])).reshape(-1, 2) if len(xy) > 1 else xy      # (25 (N-1), 2)
    inner = box.expanded(0.98, 0.9)
    return bool(((points[:, 0] > inner.x0) & (points[:, 0] < inner.x1) &
                 (points[:, 1] > inner.y0) & (points[:, 1] < inner.y1)).any())


def assert_nothing_runs_through_legends_or_texts(fig, name):
    renderer = fig.canvas.get_renderer()
    boxes = [(f"legend {legend_texts_of(leg)}", leg.get_window_extent(renderer)) for leg in legends(fig)]
    boxes += [(f"text {t.get_text()!r}", t.get_window_extent(renderer)) for ax in fig.axes for t in ax.texts]
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_label().startswith("_") and not len(line.get_xydata()):
                continue
            for what, box in boxes:
                assert not _segments_through(box, line), f"{name}: a curve runs through the {what}"
        for patch in ax.patches:
            bar = Bbox.intersection(patch.get_window_extent(renderer), ax.bbox)     # the part drawn
            for what, box in boxes:
                if bar is not None and what.startswith("legend"):
                    assert not bar.overlaps(box.expanded(0.98, 0.9)), f"{name}: a bar runs under the {what}"


def legend_texts_of(leg) -> list[str]:
    return [t.get_text() for t in leg.get_texts()]


def assert_colour_bars_labelled(fig, name):
    images = [im for ax in fig.axes for im in ax.images]
    if images:
        bars = [im.colorbar for im in images if im.colorbar is not None]
        assert bars, f"{name}: an image without a colour bar"
        for bar in bars:
            assert bar.ax.get_ylabel().strip(), f"{name}: a colour bar without a label"


CODE_NAMES = {"layer", "batch", "batch_masked", "rnn", "lstm", "transformer"}


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_study_plot_reads_well(name, tmp_path, monkeypatch, capsys):
    for fig in figures_of(name, tmp_path, monkeypatch, capsys):
        texts = legend_texts(fig) + [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()]
        assert not CODE_NAMES & set(texts), f"{name}: code names in a legend or on an axis: {texts}"
        assert_colour_bars_labelled(fig, name)
        assert_nothing_runs_through_legends_or_texts(fig, name)
        assert_texts_inside_and_apart(fig, name, fig.saved_canvas)
        matplotlib.pyplot.close(fig)


def test_the_positional_plot_at_its_default_size_keeps_each_colour_bar_label_apart(tmp_path, monkeypatch, capsys):
    """At its defaults (128 positions and dimensions: long tick labels) the first colour bar's label
    ran into the second panel's y label."""
    (fig,) = figures_of("positional", tmp_path, monkeypatch, capsys, args=[])
    assert_texts_inside_and_apart(fig, "positional", fig.saved_canvas)


def test_norms_legends_name_the_norms(tmp_path, monkeypatch, capsys):
    (fig,) = figures_of("norms", tmp_path, monkeypatch, capsys)
    texts = legend_texts(fig)
    assert {"LayerNorm", "BatchNorm", "masked BatchNorm", "running statistics (eval)"} <= set(texts)
    assert [t.get_text() for t in fig.axes[2].get_xticklabels()] == ["LayerNorm", "BatchNorm", "masked BatchNorm"]
    assert "float64 rounding: no change" in texts


def test_gradient_flow_legends_name_the_models(tmp_path, monkeypatch, capsys):
    (fig,) = figures_of("gradient-flow", tmp_path, monkeypatch, capsys)
    first = legend_texts_of(fig.axes[0].get_legend())
    assert [t.split(" (")[0] for t in first] == ["Elman RNN", "LSTM", "Transformer encoder"]


def test_xl_memory_plots_recall_accuracy(tmp_path, monkeypatch, capsys):
    (fig,) = figures_of("xl-memory", tmp_path, monkeypatch, capsys)
    (recall,) = [ax for ax in fig.axes if "recall accuracy" in ax.get_ylabel()]
    curves = {line.get_label(): line.get_ydata() for line in recall.get_lines()}
    assert {"trained with M=0", "trained with M=4"} <= set(curves)
    assert all(0 <= y <= 100 for label, ys in curves.items() if label.startswith("trained") for y in ys)
    assert list(recall.get_lines()[0].get_xdata()) == [0, 4, 8]


def test_positional_colour_bars_say_what_the_colours_are(tmp_path, monkeypatch, capsys):
    (fig,) = figures_of("positional", tmp_path, monkeypatch, capsys)
    labels = [im.colorbar.ax.get_ylabel() for ax in fig.axes for im in ax.images]
    assert labels == ["PE[pos, i]", "dot product PE[p] . PE[q]"]


def test_the_overlap_check_catches_a_legend_over_a_curve():
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], label="a diagonal")
    ax.legend(loc="center")                      # the diagonal runs through the middle
    fig.canvas.draw()
    with pytest.raises(AssertionError, match="a curve runs through the legend"):
        assert_nothing_runs_through_legends_or_texts(fig, "example")
    ax.legend(loc="upper left")                  # above the diagonal's start: clear of it
    fig.canvas.draw()
    assert_nothing_runs_through_legends_or_texts(fig, "example")
    plt.close(fig)
