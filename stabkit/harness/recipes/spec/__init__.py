"""What a recipe is: its TOML read, checked and resolved for one size (`Recipe`, `VariantSpec`, checks), and fitted to a user's model (`arch`)."""
