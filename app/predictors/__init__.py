"""Predictor registry domain: versions (candidate / production / retired), promotion, rollback, retrain runs."""
