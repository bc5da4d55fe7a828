"""Where the time goes: engine step phases, CPU and GPU step profiles, and a bench server's threads,
cores and neighbours."""
