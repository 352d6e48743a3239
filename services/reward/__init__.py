"""Reward service: verifiers that score sampled responses against reference answers.

Modules, one job each:

- `base`: the verdict a check returns, the config every verifier shares, and `Verifier`, a check
  bound to its validated config.
- `exact_match`, `math_equiv`: the built-in checks (`exact`, `math`).
- `registry`: verifier names -> check + config class; `build_verifier(name, config)`.
- `pool`: a pool of worker processes that runs each call under a deadline and abandons hung ones.
- `scoring`: `score_batch` / `score_groups`, turning verdicts and failures into `ScoredResponse`s.
- `actor`: `VerifierActor`, the thin Ray actor around `scoring`.

This package imports nothing on purpose: worker processes import only the modules their
verifier needs (an `exact` worker never loads sympy).
"""
