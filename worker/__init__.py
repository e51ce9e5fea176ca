"""The worker: serves one SKU over NATS from a backend; ours is a torch + triton runtime that splits
deciding (`engine/`) from executing (`models/`, `kernels/`)."""
