"""The reference trainer of the am-* monorepo: config, data, models, parallel, checkpoint, progress, loop.

Entry point: `integration_tests/train.py` (launched with torchrun). Not a published package: it lives next to the
integration tests that run it.
"""
