"""The tests that exercise each difference between the supported megatron-core releases.

CI runs the whole suite on the newest release (`make test MCORE=0.19.2`) and, on the oldest
(0.16.1, `make test TESTS=versioned`), only the tests marked `versioned`: the ones listed here.
tests/conftest.py marks them at collection; tests/runtime/test_versioned.py checks that every row
of runtime/versions.py's table has an entry and that every entry names a test that exists.
(tests/runtime/test_cross_release.py, which loads checkpoints across the two environments, runs in
the full suite, after both environments exist.)

Keys: the first `name` in the row's "handled by" cell (or the cell itself when it names none).
Values: test files, or `file::test` (all parametrisations of that test).
"""

VERSIONED = {
    # layer specs as ModuleSpec (<= 0.18) or functools.partial (0.19): every model build passes
    # through them; these build specs with and without extra submodules, dense and MoE.
    "spec_submodules": [
        "tests/models/test_qk_norm.py::test_the_spec_builds_the_full_width_norms_only_when_asked",
        "tests/models/test_biased_experts.py",
    ],
    # all_to_all's keywords: the alltoall token dispatcher at EP2 (and the CPU layer's own test)
    "cpu_compat": [
        "tests/lora/test_model.py::test_apply_lora_wires_expert_dropout_through_the_dispatcher",
        "tests/runtime/test_cpu_compat.py",
    ],
    # the common state's two forms, and the checked reader: save, load and resume a checkpoint
    "safe_load.load_common_state": [
        "tests/runtime/test_safe_load.py",
        "tests/training/test_resume_semantics.py::test_extending_a_finished_run",
    ],
    "safe_load.dist_load": [
        "tests/runtime/test_safe_load.py",
        "tests/training/test_resume_semantics.py::test_extending_a_finished_run",
        "tests/convert/test_roundtrip.py",
    ],
    "static_kv_cache": ["tests/inference/test_generate.py"],
    # the optimizer's gradients for the norm (renamed in 0.19) and 0.19's skip threshold: the
    # foreach norm against megatron's own, and the fallback to megatron's step
    "grads_for_norm": [
        "tests/training/test_grad_norm.py::test_the_norm_and_clip_equal_megatrons",
        "tests/training/test_optimizer.py::"
        "test_what_the_foreach_step_does_not_do_falls_back_to_megatrons_step",
    ],
    "grad_norm_skip_threshold": [
        "tests/training/test_optimizer.py::"
        "test_what_the_foreach_step_does_not_do_falls_back_to_megatrons_step",
    ],
    # the grad norm at expert-TP != TP (the three layouts that failed on 0.16.1 before the fix)
    "filter_expert_duplicates_over_expert_tp": [
        "tests/training/test_gradients.py::"
        "test_a_step_applies_the_clipped_gradient_of_the_global_mean_loss",
    ],
    # GroupedMLP is not used; the grouped path is ours (SequentialMLP under it)
    "not used: SequentialMLP only": [
        "tests/models/test_grouped_experts.py::test_grouped_moe_layer_matches_reference",
    ],
    "models/mla.py:LocalMLASelfAttention._resolve_qk_norm_config": ["tests/models/test_mla.py"],
    "mla_without_transformer_engine": ["tests/models/test_mla.py"],
}


def versioned_ids() -> set:
    """Every listed test id (files and file::test), once."""
    return {test for tests in VERSIONED.values() for test in tests}
