from tokenswift_trt.cli import main

if __name__ == "__main__":  # not when multiprocessing's spawn imports it in a tensor-parallel rank
    main()
