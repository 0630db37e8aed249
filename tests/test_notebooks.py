"""The Colab notebooks run top to bottom (nbclient), in a small setting.

Each notebook's `parameters` cell is followed by an injected cell (as
papermill does) that swaps in the tiny random model and a step or two, so a
notebook runs in well under two minutes on two CPU cores; any cell error
fails the test. The outputs are checked for what each notebook promises.
"""
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLAB = os.path.join(ROOT, "colab")


def execute(name: str, overrides: str) -> nbformat.NotebookNode:
  """Runs colab/<name> with `overrides` after its parameters cell."""
  nb = nbformat.read(os.path.join(COLAB, name), as_version=4)
  tagged = [i for i, cell in enumerate(nb.cells)
            if "parameters" in cell.metadata.get("tags", [])]
  assert len(tagged) == 1, f"{name} needs one cell tagged 'parameters'"
  nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(overrides))
  # Raises CellExecutionError, with the cell and its traceback, on any error.
  NotebookClient(nb, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": COLAB}}).execute()
  return nb


def printed(cell) -> str:
  return "".join(o.get("text", "") for o in cell.outputs
                 if o.output_type == "stream")


def has_image(cell) -> bool:
  return any("image/png" in o.get("data", {}) for o in cell.outputs)


def cell_with(nb, source: str):
  """The one code cell whose source contains `source`."""
  cells = [c for c in nb.cells if c.cell_type == "code" and source in c.source]
  assert len(cells) == 1, f"{len(cells)} cells contain {source!r}"
  return cells[0]


def test_grpo_dapo_notebook(tmp_path):
  nb = execute("grpo_dapo.ipynb", f"""
MODEL = "tiny"
STEPS, PROMPTS_PER_STEP, EVAL_EXAMPLES = 2, 1, 4
WORKDIR = {str(tmp_path / "run")!r}
""")
  group = printed(cell_with(nb, "advantage_g = train.advantages"))
  assert [line.split()[0] for line in group.splitlines()] == [f"#{i}" for i in range(8)]
  assert has_image(cell_with(nb, "GRPO advantage"))
  trained = printed(cell_with(nb, "train.run(config, WORKDIR)"))
  assert "eval_before" in trained and "eval_after" in trained
  assert has_image(cell_with(nb, 'Image(summary["plot"])'))
  evaluated = printed(cell_with(nb, "evaluation.evaluate_policy"))
  for metric in ("eval/greedy_accuracy", "eval/avg@4", "eval/pass@4", "eval/maj@4"):
    assert metric in evaluated
  with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
    assert sum(1 for _ in f) >= 2 + 2   # two steps, evaluation before and after


def test_star_notebook(tmp_path):
  nb = execute("star.ipynb", f"""
MODEL = "tiny"
PROBLEMS, EVAL_EXAMPLES, MAX_NEW_TOKENS, SFT_STEPS = 8, 4, 8, 2
FEW_SHOT = 0   # the tiny model's byte tokens: 3 exemplars exceed its 512 context
WORKDIR = {str(tmp_path / "run")!r}
""")
  plain, hinted = printed(cell_with(nb, "Rationalisation prompt")).splitlines()
  assert "correct answer is" not in plain and "correct answer is" in hinted
  ran = printed(cell_with(nb, "star_loop.run(config, WORKDIR)"))
  assert "star/kept_rationalized" in ran and "(M_0) ->" in ran
  shown = printed(cell_with(nb, "read_jsonl"))
  assert "=== Kept" in shown and "=== Rationalised" in shown
  assert has_image(cell_with(nb, "plt.subplots(1, 2"))
  assert (tmp_path / "run" / "star" / "iteration_1.jsonl").exists()


@pytest.mark.slow   # LoRA's training path: test_lora.py, test_async.py
def test_lora_grpo_notebook(tmp_path):
  nb = execute("lora_grpo.ipynb", f"""
MODEL = "tiny"
RANK = 4
STEPS, PROMPTS_PER_STEP, EVAL_EXAMPLES = 2, 1, 4
WORKDIR = {str(tmp_path / "run")!r}
""")
  shapes = printed(cell_with(nb, "trainable = sum"))
  assert shapes.count(" A (") == 7 and "trainable " in shapes
  share = float(shapes.rsplit("(", 1)[1].split("%")[0])
  assert 0 < share < 50, shapes
  same = printed(cell_with(nb, "max |logits(adapted) - logits(base)|"))
  assert same.strip().endswith("= 0.0"), same
  trained = printed(cell_with(nb, "train.run(config, WORKDIR)"))
  assert "eval_before" in trained and "eval_after" in trained
  assert has_image(cell_with(nb, 'Image(summary["plot"])'))
  saved = printed(cell_with(nb, 'fmt="peft"'))
  assert "['layers/lora']" in saved, saved
  assert "adapter_config.json" in saved and "adapter_model.safetensors" in saved
  assert (tmp_path / "run" / "peft_adapter" / "adapter_model.safetensors").exists()
