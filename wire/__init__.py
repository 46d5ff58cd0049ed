"""The protocol between coordinator and silos: tensor codec and task/result messages."""
