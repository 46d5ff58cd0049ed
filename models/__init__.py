"""The model zoo: the networks a policy's `model:` section names, built the same way by the silos
(which train them) and the coordinator (which trains FedEvg's classifier on synthetic data)."""
