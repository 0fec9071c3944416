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


def test_checkpoint_reader_deprecations_and_bitsandbytes_notice_are_dropped(monkeypatch, caplog):
    """The two FutureWarnings of every --load (megatron's checkpoint reader on torch's DCP) and
    bitsandbytes' logged notice that the optional `kernels` package is absent."""
    import logging

    monkeypatch.setattr(sys, "warnoptions", [])
    monkeypatch.delenv("RANK", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert quiet.quiet_known_warnings()
        warnings.warn("`load_state_dict` is deprecated and will be removed in future versions. "
                      "Please use `load` instead.", FutureWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.",
                      FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please "
                       "make sure you already `pip install kernels`", "No module named 'kernels'")
        logger.warning("another bitsandbytes notice")
    assert [r.getMessage() for r in caplog.records] == ["another bitsandbytes notice"]


def test_deprecations_are_said_by_rank_0_only(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])
    shown = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet.quiet_known_warnings()
            warnings.warn("old API", FutureWarning)
            warnings.warn("older API", DeprecationWarning)
            warnings.warn("this rank's own problem", UserWarning)
        shown[rank] = [str(w.message) for w in seen]
    assert shown == {"0": ["old API", "older API", "this rank's own problem"],
                     "1": ["this rank's own problem"]}
