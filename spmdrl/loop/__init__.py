"""The RL loop: `trainer.Trainer` (build, fit, step) and the components it calls by name (docs/architecture.md,
"The loop: one Trainer and the components it calls")."""
