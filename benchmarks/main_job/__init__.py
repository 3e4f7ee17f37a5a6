"""The main job: dense Horovod and every sparse method trained on scikit-learn's digits, and what each buys."""
