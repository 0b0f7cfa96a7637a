"""`kubectl ftjob`: a kubectl plugin (console script `kubectl-ftjob`) that shows one FaultTolerantTrainingJob at a
glance (`status`), draws its timeline (`timeline -o file.png`) and lists its Events (`events`).

The rendering modules are pure (a job object and a list of events in, text or a PNG out); only `cli` talks to the
apiserver.
"""
