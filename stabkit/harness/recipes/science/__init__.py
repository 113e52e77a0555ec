"""Sweeps over a recipe: LR sensitivity, lead time over seeds, the width sweep and its scaling prediction."""
