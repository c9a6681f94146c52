"""The reliability slice (`make test-reliability-slice`, run by `.ci/run` after `make test`): one case of
every file of the suite, the cheapest, at the fast trial counts, so that a stale helper or a broken fixture
fails CI instead of waiting for the next `make test-reliability`. A module of its own name, as
trial_counts.py.

SLICE maps each test file under tests/reliability to the node id (relative to the file) of its case. A
file with no entry, or an entry that names no collected test, fails the slice's collection
(tests/reliability/conftest.py); tests/reliability/test_slice.py checks the file names in `make test`.
"""

SLICE = {
    "test_bad_input.py": "test_bad_input_fails_clearly_and_leaves_the_runs_alone[a-misspelt-role-variable]",
    # The one test that runs the trainer under checkpoint_support.py's hooks: a stale hook fails here.
    "test_checkpoint_faults.py": "test_no_stop_or_crash_loses_the_saved_step",
    "test_concurrent_restarts.py": "test_two_restarts_at_once_leave_one_run_and_never_two",
    "test_device_nodes_after_a_node_reboot.py":
        "test_without_the_boot_unit_the_container_does_not_start_and_with_it_the_run_resumes",
    "test_decoys.py": "test_stops_and_restarts_spare_every_decoy_and_leave_nothing_of_the_run",
    "test_full_disk_in_a_container.py":
        "test_a_release_unpack_on_a_full_disk_fails_clearly_and_nothing_is_switched",
    "test_infra_faults.py": "test_a_changed_host_key_is_refused_until_known_hosts_is_updated",
    "test_kernel_and_driver_updates.py":
        "test_a_kernel_update_without_dkms_is_named_before_and_after_its_reboot_and_the_fix_holds",
    "test_killed_deploys.py":
        "test_a_deploy_killed_while_its_release_validates_switches_all_or_nothing[controller-and-module]",
    "test_member_faults.py":
        "test_a_member_container_stopped_mid_run_ends_the_run_and_a_deploy_brings_it_back",
    "test_playbooks_container_driver.py":
        "test_deploy_ships_the_release_into_each_container_and_starts_the_run",
    "test_provision_faults.py":
        "test_bad_input_fails_clearly_and_leaves_no_container[a-passthrough-device-the-node-lacks]",
    "test_runs_after_a_node_reboot.py": "test_a_run_stopped_on_purpose_stays_stopped_after_a_reboot",
    "test_security.py": "test_the_sudo_rule_grants_pct_and_nothing_else",
    "test_slice.py": "test_every_file_of_the_suite_has_its_case_in_the_slice",
    "test_stale_pidfiles.py": "test_stale_pidfile_signals_nothing_is_reported_and_the_start_proceeds[dead]",
    "test_stubborn_runs.py": "test_stop_kills_a_run_that_ignores_sigterm_and_leaves_nothing",
    "test_unsafe_paths.py":
        "test_a_symlinked_log_is_refused_by_restart_and_deploy_and_nothing_is_written_through_it",
    "test_worker_kills.py": "test_a_worker_killed_again_and_again_resumes_each_time_and_leaves_one_run",
}
