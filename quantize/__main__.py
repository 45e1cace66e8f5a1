from quantize.cli import main

main()
