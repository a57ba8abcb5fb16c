"""What a run shows while it trains: TensorBoard, Ray metrics, a progress bar (see monitor.py)."""
