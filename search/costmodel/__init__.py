"""The cost model: pure formulas and presets (imports nothing from the project)."""
