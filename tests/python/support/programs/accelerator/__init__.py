"""Programs run on the test accelerator, each in a fresh interpreter (support.accelerator), and the
models that bodies run there import."""
