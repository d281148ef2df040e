"""The CUDA backend: cuda-python (driver API) only, never torch. Imported only when a GPU is
asked for: importing infc must work on machines with no driver."""
