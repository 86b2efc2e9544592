"""Block and definition storage: memory / disk / Redis tiers behind one TieredStore (tiered.py). Import the modules
themselves: this package imports nothing, so that a key (key.py) or an error (errors.py) does not bring in torch."""
