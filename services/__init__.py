"""KPO-RL services: Ray actors, run driver, control plane and stores around kpo_core."""
