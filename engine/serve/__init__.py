"""Generation and OpenAI-compatible serving (Paddle engine, or FastDeploy on GPUs)."""
