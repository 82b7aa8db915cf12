"""Stage service: a middle model of a cascade (verify a lower stage's draft, extend it)."""
