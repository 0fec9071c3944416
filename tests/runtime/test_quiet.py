"""runtime/quiet.py: the known-harmless library warnings are dropped, every other one stays, and
nothing is dropped when the user asked for warnings (-W / PYTHONWARNINGS)."""

import sys
import warnings

from megatron_lora.runtime import quiet


def _shown(monkeypatch, warnoptions):
    monkeypatch.setattr(sys, "warnoptions", warnoptions)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        installed = quiet.quiet_known_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch "
                      "optimizers.", UserWarning)
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
        warnings.warn("the checkpoint was saved by another release", UserWarning)
        warnings.warn("Apex is not installed", RuntimeWarning)  # another category: kept
    return installed, [str(w.message) for w in seen]


def test_known_warnings_are_dropped_and_others_kept(monkeypatch):
    installed, shown = _shown(monkeypatch, [])
    assert installed
    assert shown == ["the checkpoint was saved by another release", "Apex is not installed"]


def test_nothing_is_dropped_when_warnings_were_asked_for(monkeypatch):
    installed, shown = _shown(monkeypatch, ["default"])
    assert not installed and len(shown) == 5


def test_main_installs_the_filters(monkeypatch, capsys):
    from megatron_lora.cli import main

    calls = []
    monkeypatch.setattr(quiet, "quiet_known_warnings", lambda: calls.append(1))
    assert main(["convert", "hf-to-mcore", "--hf-dir", "/nonexistent/hf", "--save",
                 "/nonexistent/out", "--no-progress"]) == 2
    assert calls == [1]
