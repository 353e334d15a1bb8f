"""The command line: the Typer app, one module per command group (generate: run/chat and the shell
side; models: pull/list/rm/info/devices; measure: bench/quantize/eval/frontier; cache), console
output and the options commands share.

Only this package knows the terminal, stdin, typer, rich and exit codes. It may import every other
package; it hands progress and notes down to them as callbacks.
"""
