"""capd's benchmarks: ``python -m benchmarks.run`` runs every ``bench_*.py`` module's ``main()``."""
