from delft.cli import main

main()
