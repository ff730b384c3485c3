from bench.kernels import main

main()
