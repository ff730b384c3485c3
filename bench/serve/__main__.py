from bench.serve import main

main()
