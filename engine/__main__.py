from engine.cli import run

run()
