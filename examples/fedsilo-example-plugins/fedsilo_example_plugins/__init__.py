"""An example fedsilo plug-in package: a model factory (`models.residual_cnn`) and a data
loader (`data.digits_16x16`), registered as entry points in this package's pyproject.toml, and
a policy that uses both (`policies/digits-resnet.yaml`)."""
