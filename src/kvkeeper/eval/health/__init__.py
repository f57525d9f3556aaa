"""Cache-health prediction evaluated: generated incidents (scenarios), their scoring, the held-out evaluation and the
predictors' training and tuning (python -m kvkeeper.eval.health.evaluate / train_gbt / tune_trend)."""
