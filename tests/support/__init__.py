"""What the tests and the benches (hack/bench) share; importable as `tests.support.<module>` from the repo root
(pytest's `pythonpath` ini option puts it on sys.path; a child Python gets it through `paths.importable_env`).

    paths             the repo root, and the environment a child Python needs to import this package
    polling           `wait_for`: the one way a test waits (a predicate polled with a deadline)
    ports             free loopback ports
    cluster           the local cluster from hack/cluster: its clients, images, `hack/cluster` and kubectl
    podspecs          small pod manifests the cluster tests run
    helm              helm and kubectl on the chart
    chart_releases    real `helm install`s and scratch namespaces, always cleaned up
    podfactory        PodViews and specs for the planner's unit tests (pure data)
    operator_cluster  job manifests, the operator as a real subprocess, and queries of what it made
    trainer_runs      the reference trainer under the operator and the checks of a finished run
    manager_worker    the small training program the manager tests run in subprocesses (`python -m`)
    local_job         a real lighthouse and manager_worker groups as local processes
    launch_runs       `ftjob-trainer launch` run from a test, and the checks of its report
"""
