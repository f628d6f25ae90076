from qwen_kvprep.entry import main

if __name__ == "__main__":
    main()
