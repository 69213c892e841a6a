"""What the recipes in recipes/ share: their config (YAML + key=value overrides), packed data, the accelerate
training loop, and chunked LM losses."""
