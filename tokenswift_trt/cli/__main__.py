from tokenswift_trt.cli import main

main()
