"""Thinking models: the trace they write before the answer, told apart from the answer.

style.py tells which trace a model writes; split.py cuts the streamed text into trace and answer;
gate.py keeps the answer to a grammar and ends the trace at a budget; setup.py puts these together
for one generation on a loaded model.
"""
