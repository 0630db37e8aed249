"""What a run needs around the loops: setup (`experiment`), preflight checks,
the command-line helpers (`cli`), signals (`interrupts`), the workdir lock,
output directories, metrics, the run store and sweeps."""
