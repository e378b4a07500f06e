"""The review notebook executes end to end (nbclient) on a small artifact made here, and is
committed with its outputs stripped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers.report import make_artifact, make_eval

NB = Path(__file__).resolve().parents[2] / "notebooks" / "calibration_review.ipynb"


def _kernel_manager(tmp_path):
    """A KernelManager for this interpreter (the venv) via a kernelspec in ``tmp_path`` only:
    the user's jupyter configuration is neither read for the kernel nor modified."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kdir = tmp_path / "kernels" / "kvcal-test"
    kdir.mkdir(parents=True)
    (kdir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kvcal test", "language": "python",
        "env": {"MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1"},
    }))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
    return KernelManager(kernel_name="kvcal-test", kernel_spec_manager=ksm)


def test_committed_notebook_is_stripped():
    """The committed review notebook is valid nbformat with no outputs or execution counts, and its first code
    cell is the tagged parameters cell reading KVCAL_ARTIFACT with the committed example as default."""
    import nbformat

    nb = nbformat.read(NB, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.get("tags", [])
    assert 'os.environ.get("KVCAL_ARTIFACT", "artifacts/smollm2-135m-fp8")' in code[0].source


def test_notebook_executes(tmp_path, monkeypatch):
    """The notebook runs end to end (nbclient, a throwaway kernelspec) on a small artifact and evaluation made
    here with no error output, prints the hand-known figures of those fixtures (length p50 280, PASS verdict,
    4 outlier key channels) and draws 5 PNG figures."""
    import nbformat
    from nbclient import NotebookClient

    art = make_artifact(tmp_path / "art", per_head=True, channel_absmax=True)
    monkeypatch.setenv("KVCAL_ARTIFACT", str(art))
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps(make_eval()))
    monkeypatch.setenv("KVCAL_EVAL", str(ev))
    nb = nbformat.read(NB, as_version=4)
    client = NotebookClient(nb, km=_kernel_manager(tmp_path), timeout=120,
                            resources={"metadata": {"path": str(NB.parent)}})
    client.execute()
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outs if o.output_type == "error"]
    text = "\n".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/markdown", "")) for o in outs)
    assert f"artifact: {art}" in text
    assert "**Quantized tensors: K and V**" in text and "Weight precision" in text
    assert "| length p50 | 280 | 1,024 |" in text
    assert "**Verdict for `artifact`: PASS**" in text
    assert "keys: 4 outlier channel(s)" in text
    pngs = [o for o in outs if "image/png" in o.get("data", {})]
    assert len(pngs) == 5  # memory, quality vs context, ranges, clip vs absmax, per-layer error
