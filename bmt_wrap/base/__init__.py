"""What every layer shares and that imports nothing above it: the plan's data types and prefetch rule
(what ``passes/`` produce and ``runtime/`` executes), the dtype policy, dtypes, logging and torch shims."""
