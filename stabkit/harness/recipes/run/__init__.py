"""Running a recipe: the runner, the pool of worker processes, one variant trained and measured, data-parallel variants, faults, stop requests."""
