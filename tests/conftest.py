"""Fixtures shared by the test modules; plain helper functions are in ``tests/helpers.py``."""
import fcntl
import os
import shutil
import sys
import tempfile

import pytest

# ``from helpers import ...`` works in every import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """Worker processes start as oni-train and oni-eval start them: forks of one fork server per
    process that runs tests, which imported torch, TorchRL and NLE once (tests/test_worker_start.py
    checks spawn too). Not in pytest-xdist's controller, which runs none."""
    if "PYTEST_XDIST_WORKER" in os.environ or not getattr(config.option, "numprocesses", None):
        from torchrl_oni.worker_start import use_forkserver

        use_forkserver()


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (Debian's, driven by selenium through /usr/bin/chromedriver), one per module.

    Skips the test, saying why, when selenium, chromium or chromedriver is missing or the browser
    cannot start here; quits the browser and removes its profile afterwards.
    """
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else shutil.which("chromedriver")
    if not binary or not driver_path:
        pytest.skip("chromium / chromedriver are not installed (apt-get install -y chromium chromium-driver)")
    profile = tempfile.mkdtemp(prefix="oni-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--window-size=1280,1000"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(driver_path), options=options)
    except Exception as err:  # a browser that cannot start here is an environment problem
        shutil.rmtree(profile, ignore_errors=True)
        pytest.skip(f"headless chromium did not start: {type(err).__name__}: {str(err).splitlines()[0]}")
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


_THREADS = []  # torch's thread count when the first test starts (the test modules set 1 as they load)


@pytest.fixture(autouse=True)
def _torch_threads_as_at_the_start():
    """Every test starts with torch's thread count of the session's start: a test that changed it
    (TorchRL's SerialEnv and collectors set it in this process, and so may a doctest) leaves no
    extra threads behind, which on 2 cores shared by three pytest-xdist workers would spin against
    each other and slow the next test's small in-process model many times over."""
    import torch

    if not _THREADS:
        _THREADS.append(torch.get_num_threads())
    if torch.get_num_threads() != _THREADS[0]:
        torch.set_num_threads(_THREADS[0])
    yield
    if torch.get_num_threads() != _THREADS[0]:
        torch.set_num_threads(_THREADS[0])


@pytest.fixture(scope="session")
def retrieval_run(tmp_path_factory):
    """The folder of one tiny run (``TINY``, 2048 frames) with ONI-Retrieval labelled by the
    scripted rules, trained once for the tests that read it (none writes into it)."""
    from helpers import TINY
    from torchrl_oni.train.cli import main

    logdir = tmp_path_factory.mktemp("retrieval-run") / "run"
    assert main([*TINY, "--frames", "2048", "--logdir", str(logdir), "--intrinsic-reward", "retrieval",
                 "--annotator", "scripted"]) == 0
    return logdir


@pytest.fixture(scope="module")
def scripted():
    """An embedded OpenAI-compatible server (oni-serve) with the scripted backend, on a free port."""
    from torchrl_oni.serve.embedded import start_embedded_server

    with start_embedded_server(backend="scripted", port=0) as server:
        yield server


# ------------------------------------------------------------------------------------ test tiers
# The fast tier is ``python -m pytest -m "not slow"`` (the edit loop, a few minutes); the full suite,
# what CI runs, is every test. A test is ``slow`` when it takes more than ~2 s on an idle 2-core
# CPU machine (most start processes: a training run, a benchmark script, a server, a browser
# page's run). It is either marked ``@pytest.mark.slow`` in its module or listed here: an entry
# ``file::test`` marks all of a test's parameters, ``file::test[id]`` one of them, and a
# doctest is named as pytest names it. Measure with ``python -m pytest --durations=0``;
# tests/test_tiers.py fails when an entry here names nothing.
SLOW = """
tests/test_acting.py::test_a_collector_whose_server_stops_fails_and_leaves_nothing_behind
tests/test_acting.py::test_served_rollout_equals_local_rollout[light-2-5000-cpu]
tests/test_acting.py::test_served_rollout_equals_local_rollout[oni-1-6-cpu]
tests/test_annotation_faults.py::test_slow_server_is_not_a_failure
tests/test_annotator_types.py::test_a_registered_annotator_is_a_choice_of_the_cli_labels_a_run_and_its_labels_are_stored
tests/test_benchmark_smoke.py::test_annotation_faults_smoke
tests/test_benchmark_smoke.py::test_annotation_throughput_smoke_embedded_model
tests/test_benchmark_smoke.py::test_annotation_throughput_smoke_with_a_server_url
tests/test_benchmark_smoke.py::test_env_throughput_smoke
tests/test_benchmark_smoke.py::test_label_efficiency_smoke
tests/test_benchmark_smoke.py::test_label_transfer_smoke_against_a_hand_count
tests/test_benchmark_smoke.py::test_learning_check_ellm_smoke
tests/test_benchmark_smoke.py::test_learning_check_smoke
tests/test_benchmark_smoke.py::test_store_budget_too_small_extrapolates
tests/test_benchmark_smoke.py::test_store_smoke
tests/test_benchmark_smoke.py::test_value_heads_smoke
tests/test_caption_keys.py::test_counts_equal_a_hand_count_with_the_counter_inside_each_worker
tests/test_caption_keys.py::test_counts_equal_a_hand_count_with_the_counter_outside[ParallelEnv]
tests/test_caption_keys.py::test_one_call_stack_on_every_kind_of_env[ParallelEnv]
tests/test_compile.py::test_a_run_trains_with_compile
tests/test_compile.py::test_compiled_update_equals_eager_update
tests/test_config.py::test_adding_a_reward_type_is_one_module
tests/test_cpu_share.py::test_a_part_that_exits_keeps_its_last_reading_and_grandchildren_count
tests/test_envs.py::test_check_env_specs_gym_wrapper_serial_and_parallel
tests/test_envs.py::test_parallel_env_of_batched_envs
tests/test_feedback_training.py::test_human_feedback_during_an_oni_train_run
tests/test_feedback_training.py::test_tiny_run_with_an_ensemble_disagreement_rune_and_a_budget
tests/test_goal_table_files.py::test_a_killed_process_leaves_a_table_the_next_one_removes
tests/test_import_graph.py::test_the_package_has_no_circle_and_design_md_shows_its_layers
tests/test_intrinsic_transform.py::test_parallel_env_spawn
tests/test_learner.py::test_trainer_gathers_batches_per_update
tests/test_motif_commands.py::test_a_reward_model_that_barely_moved_is_reported
tests/test_queue_order.py::test_the_benchmark_runs_at_toy_size
tests/test_ray_backend.py::test_a_runs_own_ray_instance_listens_on_loopback_only_with_token_auth
tests/test_ray_backend.py::test_joining_a_cluster_without_token_auth_warns_once
tests/test_resume_record.py::test_kill_after_checkpoint_then_resume_keeps_the_record_monotonic
tests/test_reward_types.py::test_a_new_reward_type_is_one_registration
tests/test_reward_types.py::test_the_reward_library_imports_nothing_of_the_trainer
tests/test_rewards.py::test_classifier_reaches_high_heldout_accuracy
tests/test_rewards.py::test_train_reward_model_and_motif_reward
tests/test_run_folders.py::test_a_second_run_with_the_default_folder_keeps_the_first
tests/test_run_folders.py::test_eval_never_replaces_a_file_named_by_o
tests/test_run_folders.py::test_overwrite_starts_the_run_over
tests/test_run_folders.py::test_resume_without_logdir_continues_the_newest_run
tests/test_run_folders.py::test_the_summary_names_the_new_folder
tests/test_serve.py::test_cli_usage_errors_exit_2_with_one_line[args4]
tests/test_serve.py::test_engine_skips_and_aborts_prompts_nobody_waits_for
tests/test_serve.py::test_prefix_cached_batch_matches_plain_forward
tests/test_serve_int8.py::test_a_users_checkpoint_folder_runs_in_int8_from_the_cache
tests/test_serve_int8.py::test_the_int8_copy_is_made_once_and_made_again_when_altered
tests/test_serve_local_models.py::test_a_gguf_file_converts_once_then_loads_from_the_cache
tests/test_serve_local_models.py::test_oni_serve_serves_a_folder_under_the_given_name_and_prints_its_checksum
tests/test_serve_local_models.py::test_oni_train_llm_model_names_the_embedded_judge
tests/test_spawn_check.py::test_a_guarded_script_trains
tests/test_spawn_check.py::test_an_unguarded_script_fails_at_once_naming_the_fix
tests/test_spawn_check.py::test_an_unguarded_script_that_forks_its_workers_trains
tests/test_store.py::test_hard_crash_during_save_keeps_last_good_file
tests/test_throughput_benchmarks.py::test_drop_in_overhead_smoke
tests/test_throughput_benchmarks.py::test_learner_throughput_smoke
tests/test_throughput_benchmarks.py::test_train_throughput_against_baseline_settings_smoke
tests/test_throughput_benchmarks.py::test_train_throughput_prices_a_reward_type_on_a_task_smoke
tests/test_throughput_benchmarks.py::test_trainer_ceiling_smoke
tests/test_train.py::test_a_run_with_a_death_penalty_and_a_survival_bonus_trains_and_records_them
tests/test_train.py::test_cli_short_run_prints_summary_and_json
tests/test_train.py::test_death_penalty_and_survival_bonus_are_off_by_default_and_refused_when_negative
tests/test_train.py::test_hooks_run_at_the_stages_they_declare_and_nowhere_else
tests/test_train.py::test_oni_train_resolves_its_configuration_once
tests/test_train.py::test_short_run_then_resume_continues_where_it_stopped
tests/test_train.py::test_two_value_heads_each_learn_their_own_return
tests/test_train.py::test_wandb_offline_logging_needs_no_network
tests/test_train_intrinsic.py::test_a_run_on_stored_labels_pays_only_for_what_they_cover
tests/test_train_intrinsic.py::test_bow_needs_no_llm
tests/test_train_intrinsic.py::test_caption_store_is_reused_so_labels_are_not_paid_twice
tests/test_train_intrinsic.py::test_classification_trains_in_the_background_end_to_end
tests/test_train_intrinsic.py::test_classification_trains_reward_model_between_iterations
tests/test_train_intrinsic.py::test_count_scope_run_trains_and_counts_every_paying_step
tests/test_train_intrinsic.py::test_dead_llm_url_is_one_error_line_and_exit_2
tests/test_train_intrinsic.py::test_goal_conditioned_ellm_policy_sees_goals_at_acting_time
tests/test_train_intrinsic.py::test_retrieval_scripted_labels_land_and_pay
tests/test_transform_conventions.py::test_a_parallel_env_worker_pays_its_snapshot_and_the_outer_transform_the_live_labels
tests/test_transform_conventions.py::test_a_spawned_process_computes_from_a_snapshot_and_says_so
tests/test_transform_conventions.py::test_every_reward_source_copies_and_pays_the_same[bow_minilm_sentence-cloudpickle]
tests/test_transform_conventions.py::test_every_reward_source_copies_and_pays_the_same[bow_minilm_sentence-deepcopy]
tests/test_transform_conventions.py::test_every_reward_source_copies_and_pays_the_same[bow_minilm_sentence-pickle]
tests/test_worker_faults.py::test_sigterm_ends_a_run_with_a_stopped_worker_in_bounded_time
tests/test_worker_faults.py::test_stall_past_the_restarts_ends_with_one_line
tests/test_worker_faults.py::test_worker_that_cannot_start_stops_the_run_at_once
torchrl_oni/train/backends.py::torchrl_oni.train.backends.make_collector
torchrl_oni/train/ppo.py::torchrl_oni.train.ppo
""".split()

# pytest-xdist (``-n 3``, with ``--dist loadgroup`` from pytest.ini) runs the tests of one group on
# one worker, one after another: every test that starts Ray (two instances at once on 2 cores, and
# a client that joins the other's, are not what those tests check), the ``alone`` tests (below),
# and the tests of a module that share one of its costly module-scoped fixtures (built once, not
# once per worker). xdist hands out the groups first (the largest first), then the other tests:
# the slow ones first, so that the run does not end on one long test while the other worker waits.
RAY = ("tests/test_ray_backend.py", "tests/test_benchmark_smoke.py::test_scale_out_smoke")
# module-scoped: one group per module
SHARED_FIXTURES = {"browser", "cluster", "two_default_runs", "model_server", "engines", "packaged", "minilm",
                   "labels_source", "readme_script_runs", "parallel_counted_rollout"}
SESSION_FIXTURES = {"retrieval_run"}  # one group for all the modules that use it

# Tests that run with no other test beside them under pytest-xdist, as they do in a serial run:
# they stop one of two env workers and assert it is killed within --worker-stall-timeout and a few
# seconds, which a test beside them could stretch. (The tests that kill a worker, and the prefetch
# test that needs both of two workers to deliver among the first eight batches, run beside the
# others: a worker's death is named whatever state TorchRL finds the other in, and the prefetch
# test gives the slower worker time.)
ALONE = """
tests/test_worker_faults.py::test_stopped_worker_is_killed_restarted_and_the_run_finishes
tests/test_worker_faults.py::test_weight_update_waiting_for_a_stopped_worker_is_released
""".split()


def _listed(item, names):
    return item.nodeid in names or item.nodeid.split("[")[0] in names


@pytest.hookimpl(tryfirst=True)  # before -m selects, and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    slow, alone = set(SLOW), set(ALONE)
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items:
        if _listed(item, slow):
            item.add_marker(pytest.mark.slow)
        if _listed(item, alone):
            item.add_marker(pytest.mark.alone)
        if not xdist:
            continue
        if _listed(item, alone):
            item.add_marker(pytest.mark.xdist_group("alone"))
        elif item.nodeid.startswith(RAY):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif SESSION_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(min(SESSION_FIXTURES.intersection(item.fixturenames))))
        elif SHARED_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if "PYTEST_XDIST_WORKER" in os.environ:  # a worker: every worker sorts alike (a stable sort)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# The ``alone`` tests hold a run-wide lock that every other test takes shared: one waits for the
# test running beside it to end, and the other worker's next test waits for it (and for the
# ``alone`` tests after it, one group on one worker). A gate lock, taken in turn, keeps a waiting
# ``alone`` test from being starved by the tests that keep starting beside it.
_HELD = {}  # this worker's hold of the lock between tests: {"fd": ..., "kind": ...}


def _flock(path, kind):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, kind)
    return fd


def _release():
    if _HELD:
        os.close(_HELD.pop("fd"))
        _HELD.clear()


@pytest.fixture(autouse=True)
def _alone_under_xdist(request, tmp_path_factory):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    kind = fcntl.LOCK_EX if request.node.get_closest_marker("alone") else fcntl.LOCK_SH
    if _HELD.get("kind") != kind:
        _release()
        shared = tmp_path_factory.getbasetemp().parent  # one folder for all the workers of this run
        gate = _flock(shared / "tests-gate.lock", fcntl.LOCK_EX)
        try:
            _HELD.update(fd=_flock(shared / "tests.lock", kind), kind=kind)
        finally:
            os.close(gate)
    yield
    if kind == fcntl.LOCK_SH:
        _release()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _HELD.get("kind") == fcntl.LOCK_EX and (nextitem is None or not nextitem.get_closest_marker("alone")):
        _release()
